"""The tiers of an engine whose server keeps the KV (``capabilities.remote_chat``): none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvchat.engine import Engine
from kvchat.engine.openai import REMOTE_KV_NOTE
from kvchat.kvcache import Fingerprint, RestoreResult
from kvchat.kvcache.tiers import CacheGc, HotSession, SnapshotWrite
from kvchat.store.locks import SessionLocks


class RemoteTiers:
    """The tiers of an engine whose server keeps the KV (``capabilities.remote_chat``):
    none. Nothing is saved or restored; :meth:`stats` says where the KV is."""

    def __init__(self, url: str) -> None:
        self._session = HotSession()
        self.url = url

    @property
    def hot_session_id(self) -> str | None:
        return self._session.id

    @property
    def dirty(self) -> bool:
        """Never: nothing of the server's KV is kvchat's to save."""
        return False

    def mark_dirty(self) -> None:
        """Nothing to save later."""

    def mark_hot(self, session_id: str | None) -> None:
        self._session.id = session_id

    def attach(self, engine: Engine, fingerprint: Fingerprint) -> None:
        """Nothing to attach: the KV is the server's."""

    def detach(self) -> None:
        """Nothing to save."""

    def make_hot(
        self,
        session_id: str,
        *,
        no_restore: bool = False,
        prompt: list[int] | None = None,
        history: Callable[[], list[int] | None] | None = None,
    ) -> RestoreResult:
        self._session.id = session_id
        return RestoreResult("none", reason=REMOTE_KV_NOTE)

    def spill(self) -> None:
        self._session.id = None

    def save_hot(self) -> SnapshotWrite:
        return SnapshotWrite()

    def forget(self, session_id: str) -> None:
        if self._session.id == session_id:
            self._session.id = None

    def location(self, session_id: str) -> str:
        return "none"

    def snapshot(self, session_id: str) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        """KVTiers.stats's shape, all zero, and ``remote``: where the KV is instead."""
        zeros = ("restores_ram", "restores_disk", "misses", "tokens_restored")
        return {
            "ram": {"entries": 0, "bytes": 0, "budget_bytes": 0, "hits": 0, "misses": 0},
            "disk": {
                "snapshots": 0,
                "chunks": 0,
                "bytes": 0,
                "logical_bytes": 0,
                "budget_bytes": 0,
            },
            "counters": {name: 0 for name in (*zeros, "bytes_restored", "bytes_written")},
            "remote": {"url": self.url, "note": REMOTE_KV_NOTE},
        }

    def gc(self, locks: SessionLocks | None = None) -> CacheGc:
        return CacheGc()

    def clear(self, session_id: str | None = None) -> int:
        return 0
