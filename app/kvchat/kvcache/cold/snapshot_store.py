"""The cold tier: snapshot files on disk, indexed in SQLite.

Two formats. **Chunks** (the default): the seq state is cut into token ranges of
``chunk_tokens`` cells (see :mod:`kvchat.kvcache.state.ranges`); keys and cuts come from
:mod:`kvchat.kvcache.cold.chains`, so any prefix that sessions, forks and regenerations
share is stored once, and a turn writes only the chunks that are new. **Blob**: the
whole state in one file, used when the layout parser does not recognise the bytes.

Files are written atomically (:mod:`kvchat.kvcache.cold.files`) in the formats of
:mod:`kvchat.kvcache.cold.formats`, and only then are the rows committed, so a crash leaves
the old snapshot or the new one, never a row pointing at a broken file. Deleting,
budgets and orphans are :mod:`kvchat.kvcache.cold.housekeeper`'s. Data dir 0700, files 0600.
Writing is :mod:`kvchat.kvcache.cold.writer`'s, loading
:mod:`kvchat.kvcache.cold.loader`'s (chunks read straight into the state buffer by
:mod:`kvchat.kvcache.cold.chunk_reader`); this class picks the row and composes them.

File names derive from keys (the session id, a chunk key), never from a stored path. The
snapshot directory and its ``chunks/`` directory are used only when each is a real
directory (created 0700 when missing, never chmod-ed when present): a symlink or a file in
their place disables snapshots, with the reason, and the chat goes on with full prefills.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

from kvchat.engine import SeqStateEngine
from kvchat.kvcache.cold import chains as chunking
from kvchat.kvcache.cold import checkpoints as windows
from kvchat.kvcache.cold import files as kvfiles
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chains import CHUNK_TOKENS, MIN_DONOR_TOKENS
from kvchat.kvcache.cold.files import STALL_ENV
from kvchat.kvcache.cold.housekeeper import ORPHAN_GRACE_S, Housekeeper
from kvchat.kvcache.cold.loader import SnapshotLoader
from kvchat.kvcache.cold.writer import SnapshotWriter
from kvchat.kvcache.fingerprint import Fingerprint, origin_of
from kvchat.kvcache.rejected import SnapshotRejected, SnapshotsUnavailable
from kvchat.kvcache.results import RestoreResult, SaveResult, Source
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.store import SnapshotRow, Store

# Threads reading a chain's chunks: a restore is bound by memory bandwidth, which a core
# or two more still add to.
READ_WORKERS = max(2, min(4, os.cpu_count() or 2))

__all__ = [
    "CHUNK_TOKENS",
    "MIN_DONOR_TOKENS",
    "ORPHAN_GRACE_S",
    "STALL_ENV",
    "RestoreResult",
    "SaveResult",
    "SnapshotRejected",
    "SnapshotStore",
    "SnapshotsUnavailable",
    "Source",
]


class SnapshotStore:
    """Saves and restores sessions' KV on disk, within a byte budget."""

    def __init__(
        self,
        directory: Path,
        store: Store,
        *,
        chunk_tokens: int = CHUNK_TOKENS,
        budget_bytes: int | None = None,
        chunked: bool = True,
    ) -> None:
        self.directory = directory
        self.chunk_dir = directory / "chunks"
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.budget_bytes = budget_bytes
        self.chunked = chunked
        self._workers = ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="kvchat-chunks")
        # Why snapshots are off (the directory is a symlink, a file, can't be made), or None.
        self.disabled: str | None = kvfiles.prepare_dir(directory) or kvfiles.prepare_dir(
            self.chunk_dir
        )
        self._housekeeper = Housekeeper(directory, self.chunk_dir, store, self.disabled)
        self._writer = SnapshotWriter(directory, self.chunk_dir, store, chunk_tokens)
        self._loader = SnapshotLoader(self.chunk_dir, store, self._housekeeper, self._workers)

    # --- save -----------------------------------------------------------------------------

    def save(self, session_id: str, engine: SeqStateEngine, fingerprint: Fingerprint) -> SaveResult:
        """Snapshot the context as ``session_id``'s KV, replacing its previous snapshot.

        Raises :class:`SnapshotsUnavailable` (an OSError) when snapshots are disabled.
        """
        if self.disabled is not None:
            raise SnapshotsUnavailable(f"snapshots are disabled: {self.disabled}")
        if not fmt.valid_session_id(session_id):
            raise SnapshotsUnavailable(f"not a session id kvchat makes: {session_id!r}")
        tokens = engine.tokens
        state = engine.state_get()
        previous = self.store.get_snapshot(session_id)
        pending = engine.take_checkpoints() if engine.capabilities.window_checkpoints else []
        if self.chunked:
            state, layout, why = self._parse(engine, state)
        else:
            layout, why = None, None  # whole by the user's choice (snapshot_chunks = false)
        if layout is not None:
            result = self._writer.save_chunks(
                session_id, tokens, state, layout, fingerprint, engine, pending
            )
        else:
            result = self._writer.save_blob(session_id, tokens, state, fingerprint)
            result.whole_reason = why
        self._housekeeper.clear_gone(session_id)
        if previous is not None and previous.path != result.row.path:
            self._housekeeper.remove_blob(previous)
        self.drop_unreferenced_chunks()
        result.evicted = self.enforce_budget(keep=session_id)
        result.over_budget = self.over_budget_note()
        self.store.bump_counters(bytes_written=result.bytes_written)
        return result

    @staticmethod
    def _parse(
        engine: SeqStateEngine, state: memoryview
    ) -> tuple[memoryview, kvlayout.StateLayout | None, str | None]:
        """The state (its window cells in position order: see
        :func:`kvlayout.in_position_order`) and its layout, or None and why it is stored
        whole."""
        why = engine.chunk_problem()
        if why:
            return state, None, why
        spec = engine.kv_spec()
        shape = engine.kv_shape() if spec is None else None
        if spec is None and shape is None:
            return (
                state,
                None,
                "the model's layers keep KV of different sizes and no spec says which",
            )
        try:
            if spec is not None:
                state = kvlayout.in_position_order(state, spec)
                return state, kvlayout.parse(state, spec=spec), ""
            assert shape is not None
            return state, kvlayout.parse(state, *shape), ""
        except kvlayout.LayoutError as exc:
            return state, None, f"llama.cpp's state is not a layout kvchat can cut ({exc})"

    def chunk_plan(
        self, fingerprint: Fingerprint, tokens: list[int], base: list[int]
    ) -> list[tuple[int, int, str]]:
        """(start, end, key) of every chunk of ``tokens`` (see the writer's ``chunk_plan``)."""
        return self._writer.chunk_plan(fingerprint, tokens, base)

    # --- restore --------------------------------------------------------------------------

    def restore(
        self,
        session_id: str,
        engine: SeqStateEngine,
        fingerprint: Fingerprint,
        prompt: list[int] | None = None,
    ) -> RestoreResult:
        """Load the session's own snapshot; without one, the longest prefix another has.

        Never raises for a bad snapshot: the result carries the reason instead, and the
        context is left empty for a full prefill.
        """
        started = time.perf_counter()
        try:
            if self.disabled is not None:
                raise SnapshotRejected(f"snapshots are disabled: {self.disabled}")
            row, keep = self._pick(session_id, fingerprint, prompt, engine.n_ctx)
            window = self._window_point(row, keep, prompt, engine)
            if window is not None:
                keep = window.tokens
            self._loader.load(row, engine, keep, window)
        except (SnapshotRejected, OSError) as exc:
            engine.clear()
            self.store.bump_counters(restore_misses=1)
            if isinstance(exc, SnapshotRejected):
                reason = exc.reason
            else:
                reason = f"could not read the snapshot ({exc.strerror or exc})"
            return RestoreResult("none", reason=reason)
        elapsed = (time.perf_counter() - started) * 1000
        n_bytes = engine.state_size() if keep != row.n_tokens else row.n_bytes
        self.store.touch_snapshot(row.session_id)
        self.store.bump_counters(restores_disk=1, tokens_restored=keep, bytes_restored=n_bytes)
        donor_id = row.session_id if row.session_id != session_id else None
        return RestoreResult(
            "disk",
            ms=elapsed,
            bytes=n_bytes,
            tokens=keep,
            donor=donor_id,
            origin=origin_of(row.fingerprint),
        )

    def _pick(
        self, session_id: str, fingerprint: Fingerprint, prompt: list[int] | None, n_ctx: int
    ) -> tuple[SnapshotRow, int]:
        """The row to load and how many of its tokens to keep, if it fits this context."""
        row = self.store.get_snapshot(session_id)
        if row is None:
            donor = chunking.best_donor(self.store, session_id, fingerprint, prompt, n_ctx)
            if donor is None:
                gone = self._housekeeper.gone_reason(session_id)
                raise SnapshotRejected(gone or "no snapshot saved for this session yet")
            row, keep = donor
        else:
            keep = row.n_tokens
        if row.damage:
            raise SnapshotRejected(f"the snapshot's index row is damaged ({row.damage})")
        if keep < 0:
            raise SnapshotRejected(f"the snapshot's index row is damaged ({keep} tokens)")
        reason = fingerprint.mismatch(row.fingerprint)
        if reason is not None:
            raise SnapshotRejected(reason)
        if keep > n_ctx:
            raise SnapshotRejected(f"snapshot holds {keep} tokens but n_ctx is {n_ctx}")
        return row, keep

    @staticmethod
    def _window_point(
        row: SnapshotRow, keep: int, prompt: list[int] | None, engine: SeqStateEngine
    ) -> windows.WindowPoint | None:
        """For a sliding-window chain: the checkpoint to restore at (see
        :func:`windows.choose`). A whole-state snapshot must fit the prompt as it is: its
        window can't be cut back. Raises :class:`SnapshotRejected` saying why not."""
        if row.format == "chunks" and isinstance(row.layout, dict) and "swa" in row.layout:
            windows.check_keys(row)
            return windows.choose(row, keep, prompt, engine)
        if row.format == "blob" and keep == row.n_tokens:
            # A whole state has no checkpoints: it serves any prompt the window reaches (a
            # recurrent state: only a prompt that continues it).
            target = prompt if prompt is not None else windows.continuation(row.token_ids)
            start = windows.deepest_start(row.token_ids, target)
            floor = engine.restore_floor(row.n_tokens)
            if start < floor:
                kind = "recurrent" if floor >= row.n_tokens else "sliding-window"
                raise SnapshotRejected(
                    f"{kind} model: the snapshot is stored whole ({row.n_tokens:,} tokens) "
                    f"and its {'state' if kind == 'recurrent' else 'window'} cannot be cut "
                    f"back to token {start:,} (no checkpoint there)"
                )
        return None

    # --- housekeeping (see kvchat.kvcache.cold.housekeeper) -----------------------------------

    def files(self, row: SnapshotRow) -> list[Path]:
        """The files holding a snapshot's data."""
        return self._housekeeper.files(row)

    def delete(self, session_id: str) -> None:
        """Forget a session's snapshot (its text is untouched)."""
        self._housekeeper.delete(session_id)

    def drop_unreferenced_chunks(self) -> int:
        """Delete chunks no snapshot uses any more; returns bytes freed."""
        return self._housekeeper.drop_unreferenced_chunks()

    def disk_bytes(self) -> int:
        """Bytes of snapshot data on disk (each shared chunk counted once)."""
        return self._housekeeper.disk_bytes()

    def snapshot_bytes(self, session_id: str) -> int:
        """Bytes on disk of one session's snapshot alone (its chunks, shared or not; 0 when
        it has none)."""
        row = self.store.get_snapshot(session_id)
        return 0 if row is None else self._housekeeper.snapshot_bytes(row)

    def enforce_budget(
        self,
        keep: str | None = None,
        hold: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> list[str]:
        """Evict least recently used snapshots until the disk budget holds; never text, never
        a reading the document library pins (until ``kvchat docs rm``).

        Without ``keep`` (a full pass, as ``kvchat cache gc`` runs it) damaged rows are
        dropped first (:meth:`drop_damaged`); they are not in the returned list. With
        ``hold`` (a session's turn lock), sessions with a turn running are not evicted.
        """
        if keep is None:
            self.drop_damaged()
        return self._housekeeper.enforce_budget(self.budget_bytes, keep, hold)

    def drop_damaged(self) -> dict[str, str]:
        """Remove every snapshot row that can never be loaded; returns {session id: why}.

        Damaged columns, a path that is not the session's own file name, a damaged layout,
        chunk keys that do not derive from the row's tokens (another session's, or an older
        key scheme's), chunk rows that are not ours. No file is read; only files whose names
        kvchat derives from keys are removed. Each session's next restore says why.
        """
        return self._housekeeper.drop_damaged()

    def over_budget_note(self) -> str | None:
        """A line for ``kvchat cache`` when the snapshots on disk exceed the disk budget (in
        particular when one session's snapshot alone is larger than it), else None."""
        return self._housekeeper.over_budget_note(self.budget_bytes)

    def disk_stats(self) -> dict[str, object]:
        """Figures ``kvchat cache`` can add to its disk line: ``over_budget`` (a note or None),
        ``damaged`` (rows that can never be loaded; ``cache gc`` removes them) and
        ``disabled`` (why snapshots are off, or None)."""
        damaged = 0
        for row in self.store.snapshots():
            if self._housekeeper.row_problem(row) is not None:
                damaged += 1
        return {
            "over_budget": self.over_budget_note(),
            "damaged": damaged,
            "disabled": self.disabled,
        }

    def clear(self, session_id: str | None = None) -> int:
        """Delete one session's snapshot, or all of them; returns how many."""
        return self._housekeeper.clear(session_id)

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and files no row points to."""
        return self._housekeeper.cleanup_orphans()
