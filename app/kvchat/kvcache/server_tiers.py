"""KV per session on a llama-server: its slots are the hot tier, its slot files the cold one.

The same interface as :class:`kvchat.kvcache.tiers.KVTiers`, so the conversation service
drives both alike. After each turn the session's slot is saved to a file kvchat names
(``POST /slots/{id}?action=save``); before a turn the session is made hot: already in a
slot → nothing; else its file is restored into a free or the least recently used slot
(``action=restore``), and the restore must report exactly the tokens kvchat recorded.
A server that changed (model file, size, build, context), a missing file or a short
restore → a prefill with the reason, never wrong KV. Which slot holds which session is
known to this process only; another process restores from the file.

A slot file kvchat cannot vouch for is never handed to the server (issue 27: llama.cpp can
crash on a damaged one, taking every user of the server down). Where the slot directory is
readable here — the ``server_slot_dir`` setting, a server started by ``kvchat server
start`` on this machine, or one started by hand here with ``--slot-save-path`` (issue 37,
see :mod:`kvchat.engine.server_registry`) — each file's size and checksum are recorded at
the save and checked before a restore; a file that differs is deleted and the turn
prefills, with the reason. Where it is not (a remote server, or ``server_slot_dir =
"none"``), the bytes the server reads back must be the bytes it wrote, a file whose restore
ended in a dropped connection is quarantined (never restored again, so one bad file costs
one crash at most), and every restore's KV is checked before it is used: probe tokens
read after it must give the next-token log-probabilities the KV gave when it was saved,
bit for bit (:meth:`kvchat.engine.server.ServerEngine.kv_check`); KV that differs is not
used and the turn prefills, with the reason.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from kvchat.engine.api import common_prefix
from kvchat.engine.server_http import ServerError
from kvchat.engine.server_registry import listening_slot_dir, local_server
from kvchat.errors import KvchatError
from kvchat.kvcache.cold.snapshot_store import RestoreResult
from kvchat.kvcache.server_files import SlotDir
from kvchat.kvcache.tiers import CacheGc, HotSession, SnapshotWrite
from kvchat.store import Store
from kvchat.store.locks import SessionLocks
from kvchat.store.server_slots import ServerSlotRow
from kvchat.store.store import StoreFull

if TYPE_CHECKING:
    from kvchat.engine import SlotEngine

# A donor's file is restored only when it saves this many more tokens than the slot holds.
MIN_DONOR_GAIN = 32
# Fields of the server's identity whose change makes a slot file unusable, as shown.
_IDENTITY_NAMES = {
    "model_path": "model file",
    "model_size": "model size",
    "n_params": "parameters",
    "n_vocab": "vocabulary",
    "build_info": "llama.cpp build",
    "n_ctx": "context per slot",
}


def slot_file_name(session_id: str, generation: int) -> str:
    """The file a session's slot is saved to: derived from its id (never from text), two
    names used in turn so a save never overwrites the file the index points to."""
    digest = xxhash.xxh3_128_hexdigest(f"kvchat-slot:{session_id}".encode())
    return f"kvchat-{digest}-{generation % 2}.bin"


def identity_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a slot file saved by ``saved`` cannot be restored on ``current``, or None."""
    for key, name in _IDENTITY_NAMES.items():
        if saved.get(key) != current.get(key):
            return f"the server's {name} changed ({saved.get(key)!r} → {current.get(key)!r})"
    return None


class ServerSlots:
    """Sessions' KV in a llama-server's slots and slot files (the tiers of that engine)."""

    def __init__(self, store: Store, engine: SlotEngine) -> None:
        self._session = HotSession()
        self.store = store
        self.engine = engine
        self.fingerprint = engine.identity()
        # Per slot: the session it holds for this process, what kvchat knows it holds, and
        # how many of those tokens hold a full prefill's KV.
        self._held: list[str | None] = [None] * engine.n_slots
        self._tokens: list[list[int]] = [[] for _ in range(engine.n_slots)]
        self._exact: list[int] = [0] * engine.n_slots
        self._used: list[float] = [0.0] * engine.n_slots
        # The server's slot directory, where it is readable here (None: a remote server).
        self.slot_dir: SlotDir | None = self._find_slot_dir(engine.slot_dir_setting)

    def _find_slot_dir(self, setting: str | None) -> SlotDir | None:
        """The ``server_slot_dir`` setting ("none": not readable here); else the directory
        of a ``kvchat server start`` server here, or of a llama-server started by hand
        here. A candidate only: :meth:`_checksum` drops it at the first save if the file
        the server wrote is not there."""
        if setting is not None and setting.strip().lower() in ("none", "remote", "off", "-"):
            return None
        if setting:
            path = Path(setting).expanduser()
            return SlotDir(path) if path.is_dir() else None
        model_path = str(self.fingerprint.get("model_path") or "")
        local = local_server(self.engine.server_url, model_path)
        if local is not None:
            return SlotDir(Path(local.slot_dir))
        found = listening_slot_dir(self.engine.server_url)
        return SlotDir(found) if found is not None else None

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

    # --- the engine and the hot session (as KVTiers) ------------------------------------

    def attach(self, engine: Any, fingerprint: Any = None) -> None:
        """The engine is given to the constructor; kept for the KVTiers interface."""

    def detach(self) -> None:
        """Before the service closes: save the hot session if its slot has unsaved KV."""
        if self._session.dirty and self._session.id:
            self.save_hot()

    def mark_hot(self, session_id: str | None) -> None:
        """The current slot now holds ``session_id``'s KV (None: no session's)."""
        slot = self.engine.slot
        for index, held in enumerate(self._held):
            if held is not None and held == session_id and index != slot:
                self._held[index] = None
        self._held[slot] = session_id
        self._used[slot] = time.monotonic()
        self._session.id = session_id

    @property
    def note(self) -> str:
        """Where the model runs, one line for the status bar (e.g. the plan's place)."""
        slots = f"{self.engine.n_slots} slot" + ("s" if self.engine.n_slots != 1 else "")
        return f"llama-server {self.engine.server_url} · {slots} of {self.engine.n_ctx:,} tokens"

    # --- making a session hot -------------------------------------------------------------

    def _remember_slot(self) -> None:
        """Keep what kvchat knows the current slot holds before switching away from it."""
        self._tokens[self.engine.slot] = self.engine.tokens
        self._exact[self.engine.slot] = self.engine.exact

    def _pick_slot(self) -> int:
        """A free slot, else the least recently used one (its session was saved already)."""
        for index, held in enumerate(self._held):
            if held is None:
                return index
        return min(range(len(self._held)), key=lambda i: self._used[i])

    def make_hot(
        self,
        session_id: str,
        *,
        no_restore: bool = False,
        prompt: list[int] | None = None,
        history: Callable[[], list[int] | None] | None = None,
    ) -> RestoreResult:
        """Put the session's KV in a slot: held already → nothing; else restore its file."""
        engine = self.engine
        if self._session.id and self._session.dirty and self._session.id != session_id:
            self.save_hot()
        self._remember_slot()
        if no_restore:
            slot = self._slot_of(session_id)
            engine.use_slot(self._pick_slot() if slot is None else slot, [])
            engine.clear()
            self._release(engine.slot)
            return RestoreResult("none", reason="full prefill requested (--no-restore)")
        slot = self._slot_of(session_id)
        if slot is not None:
            engine.use_slot(slot, self._tokens[slot], self._exact[slot])
            self._session.id = session_id
            self._used[slot] = time.monotonic()
            return RestoreResult("hot", tokens=engine.n_tokens)
        slot = self._pick_slot()
        engine.use_slot(slot, self._tokens[slot], self._exact[slot])
        self._release(slot)
        row = self.store.get_server_slot(session_id)
        donor = None
        if row is None:
            wanted = prompt if prompt is not None else (history() if history else None)
            row = self._donor(wanted or [])
            if row is None:
                self._count(server_misses=1)
                return RestoreResult("none", reason="no saved KV for this session on the server")
            donor = row.session_id
        problem = identity_mismatch(row.fingerprint, self.fingerprint)
        if problem is None and row.n_tokens > engine.n_ctx:
            problem = f"its {row.n_tokens:,} tokens exceed the server's context ({engine.n_ctx:,})"
        if problem is None and not row.n_tokens:
            problem = "its saved KV holds no tokens"
        if problem is None:
            problem = self._unvouched(row)
        if problem is not None:
            self._count(server_misses=1)
            return RestoreResult("none", reason=f"{problem}: full prefill")
        started = time.perf_counter()
        try:
            result = engine.slot_restore(row.filename)
        except ServerError as exc:
            engine.clear()
            self._count(server_misses=1)
            if exc.dropped:
                # The server went down with this file in hand: never again.
                self._quarantine(row, "a restore of it broke the server's connection")
                return RestoreResult(
                    "none",
                    reason=f"the server broke off while restoring its slot file ({exc}); "
                    "the file is quarantined (never restored again): full prefill",
                )
            return RestoreResult("none", reason=f"the server could not restore it ({exc})")
        restored = result["n_restored"]
        read = result["n_read"]
        if row.n_bytes and read != row.n_bytes:
            # Not the file the server wrote: never trust it, nor restore it again.
            engine.clear()
            self._count(server_misses=1)
            self._quarantine(row, f"the server read {read:,} bytes of the {row.n_bytes:,} it wrote")
            return RestoreResult(
                "none",
                reason=f"the server read {read:,} bytes of the {row.n_bytes:,} it saved "
                "(quarantined): full prefill",
            )
        if restored != row.n_tokens:
            # Never trust a slot whose tokens are not exactly the recorded ones.
            engine.clear()
            self._count(server_misses=1)
            return RestoreResult(
                "none",
                reason=f"the server restored {restored:,} of {row.n_tokens:,} tokens: full prefill",
            )
        engine.use_slot(slot, row.token_ids, row.n_exact or 0)
        if self.slot_dir is None:
            problem = self._check_restored(row)
            if problem is not None:
                engine.clear()
                self._count(server_misses=1)
                return RestoreResult("none", reason=f"{problem}: full prefill")
        self.mark_hot(session_id)
        self._count(
            server_restores=1,
            server_tokens_restored=restored,
            server_bytes_restored=max(0, read),
        )
        try:
            self.store.touch_server_slot(row.session_id)
        except StoreFull:
            pass
        return RestoreResult(
            "server",
            ms=(time.perf_counter() - started) * 1000,
            bytes=max(0, read),
            tokens=restored,
            donor=donor,
        )

    def _unvouched(self, row: ServerSlotRow) -> str | None:
        """Why kvchat will not hand the server this row's file, or None.

        Quarantined, saved before kvchat counted its exact tokens, or (slot directory
        readable here) not checksummed or not the file saved: such a file is deleted."""
        if row.quarantined:
            return f"its slot file is quarantined ({row.quarantined})"
        if row.n_exact is None:
            return "its slot file was saved before kvchat counted its exact tokens"
        if self.slot_dir is None:
            if _parse_check(row.kv_check) is None:
                return (
                    "its slot file was saved without a check kvchat can make here (the "
                    "server's slot directory is not readable here)"
                )
            return None
        if row.checksum is None:
            return "its slot file was saved without a checksum"
        problem = self.slot_dir.problem(row.filename, row.n_bytes, row.checksum)
        if problem is not None:
            self.slot_dir.remove(row.filename)
            self.store.delete_server_slots(row.session_id)
            return f"{problem}; deleted"
        return None

    def _check_restored(self, row: ServerSlotRow) -> str | None:
        """Why the KV just restored from ``row``'s file is not the KV that was saved, or
        None: its probe must give the log-probabilities it gave at the save, bit for bit."""
        check = _parse_check(row.kv_check)
        if check is None:  # checked by _unvouched before the restore
            return "its slot file was saved without a check"
        probe, expected = check
        try:
            _probe, found = self.engine.kv_check(row.token_ids, probe)
        except ServerError as exc:
            return f"the restored KV could not be checked ({exc})"
        if found != expected:
            return (
                "the restored KV does not give the next-token figures it gave when it was "
                "saved (a damaged slot file, or another server)"
            )
        return None

    def _quarantine(self, row: ServerSlotRow, reason: str) -> None:
        """Never restore ``row``'s file again (deleted too, where the directory is here)."""
        try:
            self.store.quarantine_server_slot(row.session_id, row.filename, reason)
        except StoreFull:
            pass
        if self.slot_dir is not None:
            self.slot_dir.remove(row.filename)

    def _donor(self, prompt: list[int]) -> ServerSlotRow | None:
        """Another session's slot file sharing the longest prefix with ``prompt`` (a fork,
        an edit), if it beats what the slot in use holds by :data:`MIN_DONOR_GAIN` tokens."""
        if not prompt:
            return None
        held = common_prefix(self.engine.tokens, prompt)
        best, best_shared = None, held + MIN_DONOR_GAIN - 1
        for row in self.store.server_slot_rows():
            if row.quarantined:
                continue
            shared = common_prefix(row.token_ids, prompt)
            if shared > best_shared and row.fingerprint == self.fingerprint:
                best, best_shared = row, shared
        return best

    def _count(self, **deltas: int) -> None:
        """Bump the persistent counters (their own names: not the local tiers')."""
        try:
            self.store.bump_counters(**deltas)
        except StoreFull:
            pass

    def _slot_of(self, session_id: str) -> int | None:
        for index, held in enumerate(self._held):
            if held == session_id:
                return index
        return None

    def _release(self, slot: int) -> None:
        """The slot no longer holds a session of ours (it may still hold its tokens)."""
        if self._held[slot] == self._session.id:
            self._session.id = None
            self._session.dirty = False
        self._held[slot] = None

    def spill(self) -> None:
        """Before the slot is used for something else: save the hot session if unsaved."""
        if self._session.id and self._session.dirty:
            self.save_hot()
        self._remember_slot()
        self._release(self.engine.slot)
        self._session.id = None

    # --- saving ------------------------------------------------------------------------------

    def save_hot(self) -> SnapshotWrite:
        """Save the hot session's slot to its file and record its tokens; errors reported."""
        engine = self.engine
        session_id = self._session.id
        if not session_id or engine.n_tokens == 0:
            return SnapshotWrite()
        started = time.perf_counter()
        try:
            old = self.store.get_server_slot(session_id)
            generation = 0 if old is None else old.generation + 1
            filename = slot_file_name(session_id, generation)
            result = engine.slot_save(filename)
            saved = result["n_saved"]
            tokens = engine.tokens
            if not 0 < saved <= len(tokens):
                # Tokens kvchat cannot name (a cancelled prefill): the row keeps pointing
                # to the previous file, which this save did not touch.
                return SnapshotWrite(
                    error=f"the server's slot held {saved:,} tokens, not the {len(tokens):,} "
                    "kvchat knows of: this KV was not recorded"
                )
            written = max(0, result["n_written"])
            exact = min(engine.exact, saved)
            checksum = self._checksum(filename, written)
            kv_check = None
            if checksum is None:
                # Not readable here: what the saved KV gives vouches for it at a restore.
                probe, top = engine.kv_check(tokens[:saved])
                kv_check = json.dumps({"probe": probe, "top": top})
            row = ServerSlotRow(
                session_id=session_id,
                filename=filename,
                token_ids=tokens[:saved],
                fingerprint=self.fingerprint,
                n_bytes=written,
                generation=generation,
                checksum=checksum,
                n_exact=exact,
                kv_check=kv_check,
            )
            self.store.put_server_slot(row)
            self._count(server_bytes_written=row.n_bytes)
        except (KvchatError, OSError) as exc:
            return SnapshotWrite(error=f"could not save the server's slot: {exc}")
        self._session.dirty = False
        return SnapshotWrite(
            bytes=row.n_bytes, ms=(time.perf_counter() - started) * 1000, written=row.n_bytes
        )

    def _checksum(self, filename: str, written: int) -> str | None:
        """The checksum of the file just saved, where the slot directory is here; None
        otherwise. A file not found there, or not of the size written, means the directory
        is not this server's after all: the rest of this process treats it as remote."""
        if self.slot_dir is None:
            return None
        try:
            found = self.slot_dir.check(filename)
        except OSError:
            found = None
        if found is None or found.size != written:
            self.slot_dir = None
            return None
        return found.checksum

    def forget(self, session_id: str) -> None:
        """Forget a session's slot file and slot (its text is not ours to touch)."""
        slot = self._slot_of(session_id)
        if slot is not None:
            self._release(slot)
            if slot == self.engine.slot:
                self.engine.clear()
            self._tokens[slot] = []
            self._exact[slot] = 0
        row = self.store.get_server_slot(session_id)
        if row is not None and self.slot_dir is not None:
            self.slot_dir.remove(row.filename)
        self.store.delete_server_slots(session_id)

    # --- looking ---------------------------------------------------------------------------

    def location(self, session_id: str) -> str:
        """hot (the slot in use), ram (another slot: no restore needed), disk (a slot file
        on the server) or none."""
        if session_id == self._session.id:
            return "hot"
        if self._slot_of(session_id) is not None:
            return "ram"
        return "disk" if self.store.get_server_slot(session_id) is not None else "none"

    def snapshot(self, session_id: str) -> None:
        """No snapshot files here: the server holds the KV."""
        return None

    def stats(self) -> dict[str, Any]:
        """The shape of KVTiers.stats (RAM: slots held; disk: slot files) plus the server."""
        rows = self.store.server_slot_rows()
        counters = self.store.counters()
        held = sum(1 for s in self._held if s is not None)
        return {
            "ram": {"entries": held, "bytes": 0, "budget_bytes": 0, "hits": 0, "misses": 0},
            "disk": {
                "snapshots": len(rows),
                "chunks": 0,
                "bytes": sum(r.n_bytes for r in rows),
                "logical_bytes": sum(r.n_bytes for r in rows),
                "budget_bytes": 0,
            },
            "counters": {
                "restores_ram": 0,
                "restores_disk": counters.get("server_restores", 0),
                "misses": counters.get("server_misses", 0),
                "tokens_restored": counters.get("server_tokens_restored", 0),
                "bytes_restored": counters.get("server_bytes_restored", 0),
                "bytes_written": counters.get("server_bytes_written", 0),
            },
            "server": {
                "url": self.engine.server_url,
                "slots": self.engine.n_slots,
                "slots_held": held,
                "slot_files": len(rows),
                "quarantined": sum(1 for r in rows if r.quarantined),
                "slot_dir": str(self.slot_dir.path) if self.slot_dir is not None else None,
                **self.fingerprint,
            },
        }

    def gc(self, locks: SessionLocks | None = None) -> CacheGc:
        """Rows whose server changed can never be restored there: they are dropped (the
        files are the server's, in its --slot-save-path). ``locks``: as KVTiers.gc's (a
        dropped row never held a turn's KV, so none is asked)."""
        evicted = [
            r.session_id
            for r in self.store.server_slot_rows()
            if identity_mismatch(r.fingerprint, self.fingerprint) is not None
        ]
        for session_id in evicted:
            self.store.delete_server_slots(session_id)
        return CacheGc(evicted=evicted)

    def clear(self, session_id: str | None = None) -> int:
        """Forget the slot files of one session or all; returns rows deleted."""
        if session_id is not None:
            slot = self._slot_of(session_id)
            if slot is not None:
                self._release(slot)
            return self.store.delete_server_slots(session_id)
        for slot in range(len(self._held)):
            self._release(slot)
        return self.store.delete_server_slots()


def _parse_check(raw: str | None) -> tuple[list[int], list[tuple[int, float]]] | None:
    """A row's ``kv_check`` (probe tokens, top log-probabilities), or None when there is
    none or it is not one (a damaged row: then the file is not restored)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        probe = [int(t) for t in data["probe"] if isinstance(t, int) and not isinstance(t, bool)]
        top = [(int(t), float(p)) for t, p in data["top"]]
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
        return None
    if not probe or len(probe) != len(data["probe"]) or not top:
        return None
    if not all(math.isfinite(p) for _t, p in top):
        return None
    return probe, top
