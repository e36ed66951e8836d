"""Whole-state snapshot files (the cold tier) and their index rows.

File layout (little-endian)::

    b"KVCSNAP1"  u32 header_len  header (JSON)  i32 × n_tokens  state bytes

The header repeats the index row (fingerprint, token count, state size, checksum) so a
file can be checked against its row; the xxh3-128 checksum covers tokens and state.
Files are written to ``<name>.<pid>.tmp``, fsynced, renamed, and only then is the row
committed, so a crash leaves the old snapshot or the new one, never a row pointing at a
broken file. Data dir 0700, files 0600.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash

from app.engine import Engine
from app.kvcache.fingerprint import Fingerprint
from app.store import SnapshotRow, Store

MAGIC = b"KVCSNAP1"
SUFFIX = ".kvs"
# Unreferenced snapshot files younger than this may belong to another kvchat process that
# renamed its file and is about to commit the row; older ones are orphans.
ORPHAN_GRACE_S = 60.0
# Test hook: seconds to stall halfway through writing a snapshot file, so a test can kill
# the process mid-write deterministically.
STALL_ENV = "KVCHAT_FAULT_STALL_SNAPSHOT_WRITE"

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

Source = Literal["hot", "ram", "disk", "none"]


@dataclass
class RestoreResult:
    """How the session was made hot, for the turn report."""

    source: Source
    ms: float = 0.0
    bytes: int = 0
    tokens: int = 0
    reason: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "from": self.source,
            "ms": round(self.ms, 2),
            "bytes": self.bytes,
            "tokens": self.tokens,
            "reason": self.reason,
        }


def checksum(tokens: bytes, state: memoryview | bytes) -> str:
    h = xxhash.xxh3_128()
    h.update(tokens)
    h.update(state)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SnapshotStore:
    """The cold tier: one whole-state file per session, indexed in SQLite."""

    def __init__(self, directory: Path, store: Store) -> None:
        self.directory = directory
        self.store = store
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    # --- save -----------------------------------------------------------------------------

    def save(self, session_id: str, engine: Engine, fingerprint: Fingerprint) -> SnapshotRow:
        """Write the context's seq state and token ids, then point the session's row at it."""
        tokens = engine.tokens
        token_bytes = array("i", tokens).tobytes()
        state = engine.state_get()
        digest = checksum(token_bytes, state)
        header = json.dumps(
            {
                "session_id": session_id,
                "fingerprint": fingerprint.to_dict(),
                "n_tokens": len(tokens),
                "n_bytes": len(state),
                "checksum": digest,
            },
            sort_keys=True,
        ).encode()
        name = f"{session_id}-{time.time_ns():x}{SUFFIX}"
        final = self.directory / name
        tmp = self.directory / f"{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb", buffering=0) as fh:
                fh.write(MAGIC + struct.pack("<I", len(header)) + header + token_bytes)
                half = len(state) // 2
                fh.write(state[:half])
                stall = os.environ.get(STALL_ENV)
                if stall:
                    os.fsync(fh.fileno())
                    time.sleep(float(stall))
                fh.write(state[half:])
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        previous = self.store.get_snapshot(session_id)
        row = SnapshotRow(
            session_id=session_id,
            path=name,
            n_tokens=len(tokens),
            token_ids=tokens,
            fingerprint=fingerprint.to_dict(),
            n_bytes=len(state),
            checksum=digest,
        )
        self.store.put_snapshot(row)
        if previous is not None and previous.path != name:
            (self.directory / previous.path).unlink(missing_ok=True)
        return row

    # --- restore --------------------------------------------------------------------------

    def restore(
        self, session_id: str, engine: Engine, fingerprint: Fingerprint, n_ctx: int
    ) -> RestoreResult:
        """Validate the session's snapshot and load it into ``engine``.

        Never raises for a bad snapshot: the result carries the reason instead, and the
        context is left empty for a full prefill.
        """
        started = time.perf_counter()
        row = self.store.get_snapshot(session_id)
        if row is None:
            return RestoreResult("none", reason="no snapshot saved for this session yet")
        reason = fingerprint.mismatch(row.fingerprint)
        if reason is None and row.n_tokens > n_ctx:
            reason = f"snapshot holds {row.n_tokens} tokens but n_ctx is {n_ctx}"
        if reason is None:
            reason = self._load(row, engine)
        if reason is not None:
            engine.clear()
            return RestoreResult("none", reason=reason)
        elapsed = (time.perf_counter() - started) * 1000
        self.store.touch_snapshot(session_id)
        return RestoreResult("disk", ms=elapsed, bytes=row.n_bytes, tokens=row.n_tokens)

    def _load(self, row: SnapshotRow, engine: Engine) -> str | None:
        """Map, verify and load one snapshot file; the reason it failed, or None.

        The file is mapped read-only with MAP_POPULATE: no copy into a Python buffer,
        the checksum and llama.cpp both read the page cache directly.
        """
        path = self.directory / row.path
        try:
            fh = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return f"snapshot file is missing: {path}"
        with fh:
            actual = os.fstat(fh.fileno()).st_size
            prefix = fh.read(12)
            if len(prefix) < 12 or prefix[:8] != MAGIC:
                return f"{path.name} is not a kvchat snapshot file (bad magic)"
            (header_len,) = struct.unpack("<I", prefix[8:])
            tokens_at = 12 + header_len
            state_at = tokens_at + 4 * row.n_tokens
            expected = state_at + row.n_bytes
            if actual != expected:
                return f"snapshot file is truncated or padded ({actual} of {expected} bytes)"
            mapped = mmap.mmap(
                fh.fileno(), actual, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ
            )
        try:
            return self._load_mapped(row, engine, mapped, tokens_at, state_at)
        finally:
            mapped.close()

    @staticmethod
    def _load_mapped(
        row: SnapshotRow, engine: Engine, mapped: mmap.mmap, tokens_at: int, state_at: int
    ) -> str | None:
        try:
            header = json.loads(mapped[12:tokens_at])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "snapshot header is corrupt"
        if (
            header.get("n_tokens") != row.n_tokens
            or header.get("n_bytes") != row.n_bytes
            or header.get("checksum") != row.checksum
            or header.get("fingerprint") != row.fingerprint
        ):
            return "snapshot header does not match its index row"
        token_bytes = mapped[tokens_at:state_at]
        if token_bytes != array("i", row.token_ids).tobytes():
            return "snapshot token ids do not match its index row"
        state = np.frombuffer(mapped, dtype=np.uint8, count=row.n_bytes, offset=state_at)
        try:
            if checksum(token_bytes, state) != row.checksum:
                return "snapshot checksum mismatch: the file is corrupt"
            pointer = ctypes.cast(state.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
            if not engine.state_set(pointer, row.n_bytes, row.token_ids):
                return "llama.cpp rejected the snapshot state"
        finally:
            del state
        return None

    # --- housekeeping ---------------------------------------------------------------------

    def delete(self, session_id: str) -> None:
        row = self.store.get_snapshot(session_id)
        self.store.delete_snapshot(session_id)
        if row is not None:
            (self.directory / row.path).unlink(missing_ok=True)

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and snapshot files no row points to."""
        referenced = self.store.snapshot_paths()
        removed: list[str] = []
        now = time.time()
        for entry in self.directory.iterdir():
            name = entry.name
            if name.endswith(".tmp"):
                pid_text = name.rsplit(".", 2)[-2]
                if pid_text.isdigit() and _pid_alive(int(pid_text)) and int(pid_text) != os.getpid():
                    continue
            elif name.endswith(SUFFIX):
                if name in referenced or now - entry.stat().st_mtime < ORPHAN_GRACE_S:
                    continue
            else:
                continue
            entry.unlink(missing_ok=True)
            removed.append(name)
        return removed

    def total_bytes(self) -> int:
        return sum(e.stat().st_size for e in self.directory.iterdir() if e.name.endswith(SUFFIX))
