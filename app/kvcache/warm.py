"""The warm tier: recently used sessions' seq state in host RAM, LRU within a byte budget."""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class WarmEntry:
    tokens: list[int]
    data: bytearray
    model_id: str

    @property
    def n_bytes(self) -> int:
        return len(self.data)

    def pointer(self) -> ctypes.Array[ctypes.c_uint8]:
        return (ctypes.c_uint8 * len(self.data)).from_buffer(self.data)


class WarmTier:
    """Per process: the state a session had when it stopped being hot."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, WarmEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(e.n_bytes for e in self._entries.values())

    def put(self, session_id: str, tokens: list[int], state: memoryview, model_id: str) -> bool:
        """Keep a copy of ``state``; evicts the least recently used; False when it can't fit."""
        self._entries.pop(session_id, None)
        if len(state) > self.budget_bytes or not tokens:
            return False
        while self._entries and self.bytes + len(state) > self.budget_bytes:
            self._entries.popitem(last=False)
        self._entries[session_id] = WarmEntry(list(tokens), bytearray(state), model_id)
        return True

    def get(self, session_id: str, model_id: str) -> WarmEntry | None:
        entry = self._entries.get(session_id)
        if entry is None or entry.model_id != model_id:
            self.misses += 1
            return None
        self._entries.move_to_end(session_id)
        self.hits += 1
        return entry

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def clear(self) -> None:
        self._entries.clear()
