"""The warm tier: recently used sessions' seq state in host RAM, LRU within a byte budget."""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

from kvchat.kvcache import defects

# A buffer has room for a few turns' growth, so that a session spilled again (a turn
# longer) reuses it: a fresh ~100 MB buffer page-faults on every 4 KiB it is first written
# (~50 ms of a session switch, measured on 2 cores). Not asked for huge pages: with the
# kernel's usual "defrag=madvise", getting them stalled a switch for 100-250 ms.
PAGE = 1 << 20
HEADROOM = 4 << 20


def _capacity(size: int) -> int:
    return -(-(size + HEADROOM) // PAGE) * PAGE


@dataclass
class WarmEntry:
    tokens: list[int]
    buffer: bytearray  # the state is its first n_bytes
    n_bytes: int
    model_id: str
    origin: str | None = None  # see Fingerprint.origin

    def pointer(self) -> ctypes.Array[ctypes.c_uint8]:
        return (ctypes.c_uint8 * self.n_bytes).from_buffer(self.buffer)


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
        """Memory held: the buffers, room to grow included."""
        return sum(len(e.buffer) for e in self._entries.values())

    def put(
        self,
        session_id: str,
        tokens: list[int],
        state: memoryview,
        model_id: str,
        origin: str | None = None,
    ) -> bool:
        """Keep a copy of ``state``; evicts the least recently used; False when it can't fit.

        The copy goes into a buffer already written once where there is one (the session's
        own, or one evicted now), so it costs a copy, not page faults.
        """
        if defects.planted("stale-ram") and session_id in self._entries:  # test-only
            return True
        size = len(state)
        freed = [self._entries.pop(session_id)] if session_id in self._entries else []
        needed = _capacity(size)
        if needed > self.budget_bytes or not tokens:
            return False
        while self._entries and self.bytes + needed > self.budget_bytes:
            freed.append(self._entries.popitem(last=False)[1])
        buffer = next((e.buffer for e in freed if size <= len(e.buffer)), None)
        if buffer is None or self.bytes + len(buffer) > self.budget_bytes:
            buffer = bytearray(needed)
        del freed
        memoryview(buffer)[:size] = state
        self._entries[session_id] = WarmEntry(list(tokens), buffer, size, model_id, origin)
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
