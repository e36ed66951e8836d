"""One interface over the KV tiers: hot (the engine's context) → warm (RAM) → cold (disk).

The order of the tiers lives here and only here: making a session hot looks in the
context, then RAM, then disk; a session leaving the context goes to RAM (and to disk
first when the context holds KV no snapshot has yet). Which session is hot, and whether
its KV is unsaved, is assigned only by this class.
"""

from __future__ import annotations

import errno
import sqlite3
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvchat.engine import Engine, SeqStateEngine, TokenEngine, common_prefix
from kvchat.errors import KvchatError
from kvchat.kvcache import Fingerprint, RestoreResult, SnapshotStore
from kvchat.kvcache.cold import checkpoints as windows
from kvchat.kvcache.warm import WarmTier
from kvchat.store import SnapshotRow, Store
from kvchat.store.locks import SessionLocks
from kvchat.store.store import DamagedDatabase, StoreFull

if TYPE_CHECKING:
    from kvchat.config import Settings

# A snapshot sharing fewer tokens than this with the prompt (and not wholly in it) is not
# restored: the prefill would re-read nearly everything anyway.
USEFUL_PREFIX = 64
# Counters kept in the store, as ``kvchat cache`` names them.
_COUNTERS = {
    "restores_ram": "restores_ram",
    "restores_disk": "restores_disk",
    "misses": "restore_misses",
    "tokens_restored": "tokens_restored",
    "bytes_restored": "bytes_restored",
    "bytes_written": "bytes_written",
}


@dataclass
class SnapshotWrite:
    """What saving the hot context to disk did; ``error`` instead of an exception."""

    bytes: int = 0  # the snapshot's state size
    ms: float = 0.0
    error: str | None = None
    written: int = 0  # bytes written to disk for it (only new chunks)
    chunks_written: int = 0
    chunks_shared: int = 0
    # Why the KV was stored whole (one blob, no shared prefix), or None when chunked.
    whole_reason: str | None = None
    # Window checkpoints written (sliding-window models).
    checkpoints_written: int = 0


@dataclass
class CacheGc:
    """What ``kvchat cache gc`` removed: orphaned files, unused chunks, snapshots over budget."""

    orphans: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    evicted: list[str] = field(default_factory=list)


@dataclass
class HotSession:
    """Which session's KV the hot tier holds, and whether it has changed since its last save
    (held by the local tiers, a llama-server's slots and a remote server's none)."""

    # The session whose KV the hot tier holds (None: no session's).
    id: str | None = None
    # The hot KV holds what no saved copy has yet (e.g. a failed save).
    dirty: bool = False
    # Where the hot KV came from when it was not computed here (a bundle's, restored):
    # what is saved from it stays in that origin's trust domain (Fingerprint.origin).
    origin: str | None = None


class Tiers(Protocol):
    """Where sessions' KV lives, as the conversation service drives it: :class:`KVTiers`
    (the context, RAM and disk) and ``ServerSlots`` (a llama-server's slots and slot files)
    both implement it."""

    @property
    def hot_session_id(self) -> str | None: ...

    @property
    def dirty(self) -> bool: ...

    def mark_dirty(self) -> None: ...

    def mark_hot(self, session_id: str | None) -> None: ...

    def attach(self, engine: Engine, fingerprint: Fingerprint) -> None: ...

    def detach(self) -> None: ...

    def make_hot(
        self,
        session_id: str,
        *,
        no_restore: bool = False,
        prompt: list[int] | None = None,
        history: Callable[[], list[int] | None] | None = None,
    ) -> RestoreResult: ...

    def spill(self) -> None: ...

    def save_hot(self) -> SnapshotWrite: ...

    def forget(self, session_id: str) -> None: ...

    def location(self, session_id: str) -> str: ...

    def snapshot(self, session_id: str) -> SnapshotRow | None: ...

    def stats(self) -> dict[str, Any]: ...

    def gc(self, locks: SessionLocks | None = None) -> CacheGc: ...

    def clear(self, session_id: str | None = None) -> int: ...


class KVTiers:
    """Sessions' KV across the context, RAM and disk; the engine is attached once loaded."""

    def __init__(self, store: Store, cold: SnapshotStore, warm: WarmTier) -> None:
        self._session = HotSession()
        self.store = store
        self.cold = cold
        self.warm = warm
        # The attached engine's token-level role, and its seq-state role where it has one.
        self.engine: TokenEngine | None = None
        self.state: SeqStateEngine | None = None
        self.fingerprint: Fingerprint | None = None

    @classmethod
    def open(cls, directory: Path, store: Store, settings: Settings) -> KVTiers:
        """The tiers with the settings' budgets; leftovers of crashed writers are removed."""
        cold = SnapshotStore(
            directory,
            store,
            chunk_tokens=settings.chunk_tokens,
            budget_bytes=int(settings.disk_cache_gib * 2**30),
            chunked=settings.snapshot_chunks,
        )
        try:
            cold.cleanup_orphans()
        except (OSError, StoreFull):
            pass  # housekeeping: `kvchat cache gc` tries again; the chat needs none of it
        return cls(store, cold, WarmTier(settings.ram_cache_mib * 2**20))

    @property
    def hot_session_id(self) -> str | None:
        """The session whose KV the hot tier holds (None: no session's)."""
        return self._session.id

    @property
    def dirty(self) -> bool:
        return self._session.dirty

    def mark_dirty(self) -> None:
        """The hot KV has changed since its last save."""
        self._session.dirty = True

    # --- the engine and the hot session ---------------------------------------------------

    def attach(self, engine: Engine, fingerprint: Fingerprint) -> None:
        """Use this engine's context as the hot tier; ``fingerprint`` identifies its KV."""
        self.engine = engine.token_level()
        if self.engine is None:
            raise KvchatError("this engine takes whole messages: its KV is not kvchat's to keep")
        self.state = engine.seq_state()
        self.fingerprint = fingerprint

    def detach(self) -> None:
        """Before the engine closes: save the hot session if it has unsaved KV."""
        if self.engine is not None and self._session.dirty and self._session.id:
            self.save_hot()
        self.engine = None
        self.state = None

    def mark_hot(self, session_id: str | None) -> None:
        """The context now holds ``session_id``'s KV (None: nothing a session can reuse)."""
        self._session.id = session_id

    def _attached(self) -> tuple[TokenEngine, Fingerprint]:
        if self.engine is None or self.fingerprint is None:
            raise RuntimeError("KVTiers: no engine attached")
        return self.engine, self.fingerprint

    # --- moving KV between tiers ----------------------------------------------------------

    def make_hot(
        self,
        session_id: str,
        *,
        no_restore: bool = False,
        prompt: list[int] | None = None,
        history: Callable[[], list[int] | None] | None = None,
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it.

        Hot (already in the context) → RAM → disk (its own snapshot, or with ``prompt``
        the longest prefix another session's snapshot shares) → none. Without a prompt
        and without a snapshot of its own (a new branch), ``history()`` gives the prompt.
        """
        engine, fingerprint = self._attached()
        if no_restore:
            self.spill()
            engine.clear()
            self._session.origin = None
            return RestoreResult("none", reason="full prefill requested (--no-restore)")
        if session_id == self._session.id:
            if prompt is None or self._can_cut(engine, engine.tokens, prompt, hot=True):
                return RestoreResult("hot", tokens=engine.n_tokens)
            # A sliding-window context cannot be cut back there: a checkpoint on disk can.
        self.spill()
        self._session.origin = None
        state = self.state
        if state is None:
            engine.clear()
            return RestoreResult("none", reason="this engine cannot restore saved KV")
        if prompt is None and history is not None and self.store.get_snapshot(session_id) is None:
            prompt = history()
        started = time.perf_counter()
        entry = self.warm.get(session_id, fingerprint.model_id)
        if entry is not None and not self._can_cut(engine, entry.tokens, prompt):
            entry = None  # its window can't be cut back to the prompt: try the disk
        if entry is not None and len(entry.tokens) <= engine.n_ctx:
            if state.state_set(entry.pointer(), entry.n_bytes, entry.tokens):
                self._session.id = session_id
                self._session.origin = entry.origin
                # Timed before the counters' commit: the restore is the memcpy, not SQLite's.
                elapsed = (time.perf_counter() - started) * 1000
                self._count(
                    restores_ram=1, tokens_restored=len(entry.tokens), bytes_restored=entry.n_bytes
                )
                return RestoreResult(
                    "ram", ms=elapsed, bytes=entry.n_bytes, tokens=len(entry.tokens)
                )
            self.warm.drop(session_id)
        prompt = self._choose_snapshot(session_id, prompt, history)
        unused = self._unused_snapshot(session_id, prompt)
        if unused is not None:
            engine.clear()
            self._session.id = session_id
            return RestoreResult("none", reason=unused)
        try:
            result = self.cold.restore(session_id, state, fingerprint, prompt)
        except StoreFull as exc:
            # Restoring also touches the index (last use, counters); with the disk full the
            # turn goes on from an empty context rather than fail.
            engine.clear()
            result = RestoreResult("none", reason=f"{exc}: full prefill")
        self._session.id = session_id
        self._session.origin = result.origin if result.source == "disk" else None
        return result

    def _choose_snapshot(
        self,
        session_id: str,
        prompt: list[int] | None,
        history: Callable[[], list[int] | None] | None,
    ) -> list[int] | None:
        """Of the session's current and shelved snapshots (one per setting: see
        ``Store.shelved_snapshots``), make current the one this context can load that shares
        the most with the prompt; returns the prompt (the history's when none was given and
        there is a choice to make)."""
        shelved = self.store.shelved_snapshots(session_id)
        if not shelved:
            return prompt
        if prompt is None and history is not None:
            prompt = history()

        def reach(row: SnapshotRow | None) -> int:
            if row is None or not self._loadable(row):
                return -1
            return row.n_tokens if prompt is None else common_prefix(row.token_ids, prompt)

        best = max(shelved, key=reach)
        if reach(best) > reach(self.store.get_snapshot(session_id)):
            try:
                self.store.promote_snapshot(session_id, best.fingerprint)
            except KvchatError:
                pass  # (a full disk) the current one is restored, or its reason given
        return prompt

    def _unused_snapshot(self, session_id: str, prompt: list[int] | None) -> str | None:
        """Why the session's snapshot is not worth restoring for this prompt (it shares only
        the first few tokens: another n_ctx's window, an edited start), or None. A turn
        line then says so instead of "restored N tokens" that the prefill would not use.
        A snapshot that holds what follows the shared start further on is used: the turn
        shifts the messages that left the window out of it."""
        row = self.store.get_snapshot(session_id)
        if prompt is None or row is None or not self._loadable(row):
            return None  # the restore says why it cannot load it
        shared = common_prefix(row.token_ids, prompt)
        if shared >= min(row.n_tokens, USEFUL_PREFIX) or _holds_later(
            row.token_ids, prompt, shared
        ):
            return None
        return (
            f"its saved KV ({row.n_tokens:,} tokens) shares only {shared:,} tokens with "
            "this prompt: full prefill"
        )

    def _loadable(self, row: SnapshotRow) -> bool:
        """Whether this context could load ``row`` (undamaged, fits n_ctx, same fingerprint);
        the restore itself says why not."""
        engine, fingerprint = self._attached()
        return (
            not row.damage
            and row.n_tokens <= engine.n_ctx
            and fingerprint.mismatch(row.fingerprint) is None
        )

    @staticmethod
    def _can_cut(
        engine: TokenEngine, held: list[int], prompt: list[int] | None, hot: bool = False
    ) -> bool:
        """Whether a context holding ``held`` can be cut where the prompt's prefill starts
        (a sliding-window state keeps only its window's cells: see
        :mod:`kvchat.kvcache.cold.checkpoints`). The hot context can also be cut at a
        window checkpoint the engine holds in RAM; else a checkpoint on disk serves."""
        target = prompt if prompt is not None else windows.continuation(held)
        floor = engine.window_floor if hot else engine.restore_floor(len(held))
        point = engine.reuse_point(held, target)
        return point >= floor or (hot and engine.held_checkpoint(point) > 0)

    def _count(self, **deltas: int) -> None:
        """Bump the persistent counters; figures are not worth failing a turn for."""
        try:
            self.store.bump_counters(**deltas)
        except StoreFull:
            pass

    def spill(self) -> None:
        """Before the context is overwritten: keep the hot session's KV (disk and RAM)."""
        engine = self.state
        if self._session.id and self.engine is not None and self.engine.n_tokens:
            if engine is not None:
                if self._session.dirty:
                    self.save_hot()
                assert self.fingerprint is not None
                self.warm.put(
                    self._session.id,
                    engine.tokens,
                    engine.state_get(),
                    self.fingerprint.model_id,
                    self._session.origin,
                )
        self._session.id = None

    def save_hot(self) -> SnapshotWrite:
        """Snapshot the hot context to disk; a failure is reported, never raised."""
        held = self.engine.n_tokens if self.engine is not None else 0
        if not self._session.id or not held or self.fingerprint is None:
            return SnapshotWrite()
        engine = self.state
        if engine is None:
            return SnapshotWrite(error="this engine cannot save its KV")
        started = time.perf_counter()
        try:
            fingerprint = self.fingerprint.with_origin(self._session.origin)
            saved = self.cold.save(self._session.id, engine, fingerprint)
        except DamagedDatabase as exc:
            return SnapshotWrite(error=str(exc))
        except (OSError, KvchatError, sqlite3.Error) as exc:
            return SnapshotWrite(error=_save_error(exc))
        self._session.dirty = False
        return SnapshotWrite(
            bytes=saved.row.n_bytes,
            ms=(time.perf_counter() - started) * 1000,
            written=saved.bytes_written,
            chunks_written=saved.chunks_written,
            chunks_shared=saved.chunks_shared,
            whole_reason=saved.whole_reason,
            checkpoints_written=saved.checkpoints_written,
        )

    def forget(self, session_id: str) -> None:
        """Remove a session's KV from every tier (its text is not ours to touch)."""
        if self._session.id == session_id:
            self._session.id = None
            self._session.dirty = False
            self._session.origin = None
            if self.engine is not None:
                self.engine.clear()
        self.warm.drop(session_id)
        self.cold.delete(session_id)

    # --- looking ---------------------------------------------------------------------------

    def location(self, session_id: str) -> str:
        """Where this session's KV lives now: hot, ram, disk or none."""
        if session_id == self._session.id:
            return "hot"
        if session_id in self.warm:
            return "ram"
        return "disk" if self.store.get_snapshot(session_id) is not None else "none"

    def snapshot(self, session_id: str) -> SnapshotRow | None:
        """The session's own snapshot on disk, if any."""
        return self.store.get_snapshot(session_id)

    def stats(self) -> dict[str, Any]:
        """Both tiers and the persistent counters, for ``kvchat cache`` and the app."""
        rows = self.store.snapshots()
        counters = self.store.counters()
        return {
            "ram": {
                "entries": len(self.warm),
                "bytes": self.warm.bytes,
                "budget_bytes": self.warm.budget_bytes,
                "hits": self.warm.hits,
                "misses": self.warm.misses,
            },
            "disk": {
                "snapshots": len(rows),
                "chunks": len(self.store.all_chunks()),
                "bytes": self.cold.disk_bytes(),
                "logical_bytes": sum(r.n_bytes for r in rows),
                "budget_bytes": self.cold.budget_bytes,
            },
            "counters": {name: counters.get(key, 0) for name, key in _COUNTERS.items()},
        }

    # --- housekeeping ----------------------------------------------------------------------

    def gc(self, locks: SessionLocks | None = None) -> CacheGc:
        """Remove orphaned files and unused chunks, then evict snapshots over the disk budget
        (with ``locks``, only of sessions whose turn lock is free: as a turn would)."""
        orphans = self.cold.cleanup_orphans()
        freed = self.cold.drop_unreferenced_chunks()
        hold = None if locks is None else (lambda session_id: locks.hold(session_id, wait_s=0))
        evicted = self.cold.enforce_budget(hold=hold)
        return CacheGc(orphans=orphans, freed_bytes=freed, evicted=evicted)

    def clear(self, session_id: str | None = None) -> int:
        """Delete the saved KV (disk and RAM) of one session or all; returns snapshots deleted."""
        if session_id is None:
            self.warm.clear()
        else:
            self.warm.drop(session_id)
        return self.cold.clear(session_id)


def _holds_later(held: list[int], prompt: list[int], start: int, probe: int = 32) -> bool:
    """Whether ``held`` contains the prompt's next ``probe`` tokens after ``start`` somewhere
    further on (a window shift would reuse them)."""
    needle = array("i", prompt[start : start + probe]).tobytes()
    if len(needle) < 4 * min(probe, 8):
        return False
    hay = array("i", held[start:]).tobytes()
    at = hay.find(needle)
    while at != -1 and at % 4:
        at = hay.find(needle, at + 1)
    return at != -1


def _save_error(exc: BaseException) -> str:
    """Why a snapshot was not saved, in one line; a full disk is named as such."""
    text = str(exc)
    full = isinstance(exc, StoreFull) or (isinstance(exc, sqlite3.Error) and "full" in text)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full, text = True, exc.strerror or text
    if full:
        return f"the disk is full: the KV snapshot was not saved ({text.removeprefix('the disk is full: ')})"
    return f"could not save the KV snapshot: {text}"
