"""The cold tier: snapshot files on disk, indexed in SQLite.

Two formats. **Chunks** (the default): the seq state is cut into token ranges of
``chunk_tokens`` cells (see :mod:`kvchat.kvcache.layout`); a chunk's key hashes the
fingerprint and every token id up to the chunk's end, so any prefix that sessions,
forks and regenerations share is stored once, and a turn writes only the chunks that
are new (the full ones it completed, plus the trailing partial one). **Blob**: the whole
state in one file, used when the layout parser does not recognise the bytes.

Files are written to ``<name>.<pid>.tmp``, fsynced, renamed, and only then are the rows
committed, so a crash leaves the old snapshot or the new one, never a row pointing at a
broken file. A file no row points to is an orphan and is removed. Data dir 0700, files
0600. File layouts (little-endian)::

    blob:   b"KVCSNAP1" u32 header_len header(JSON) i32 × n_tokens state
    chunk:  b"KVCCHNK1" u32 header_len header(JSON) chunk bytes

Each header repeats its index row; xxh3-128 checksums cover the data.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash
from concurrent.futures import ThreadPoolExecutor

from kvchat.engine import Engine, common_prefix
from kvchat.kvcache import layout as kvlayout
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.store import ChunkRow, SnapshotRow, Store

MAGIC = b"KVCSNAP1"
CHUNK_MAGIC = b"KVCCHNK1"
SUFFIX = ".kvs"
CHUNK_SUFFIX = ".kvc"
CHUNK_TOKENS = 256
# A shared prefix shorter than this is not worth borrowing from another session.
MIN_DONOR_TOKENS = 32
# Unreferenced files younger than this may belong to another kvchat process that renamed
# its file and is about to commit the row; older ones are orphans.
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
    # Set when the KV came from another session sharing this one's prefix (a fork, an edit).
    donor: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "from": self.source,
            "ms": round(self.ms, 2),
            "bytes": self.bytes,
            "tokens": self.tokens,
            "reason": self.reason,
            "donor": self.donor,
        }


@dataclass
class SaveResult:
    row: SnapshotRow
    bytes_written: int
    chunks_written: int = 0
    chunks_shared: int = 0
    evicted: list[str] = field(default_factory=list)


def checksum(*parts: Any) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
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


def _write_atomically(final: Path, parts: list[Any]) -> int:
    """Write ``parts`` to ``final`` via a fsynced temp file and a rename; returns bytes."""
    tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as fh:
            stall = os.environ.get(STALL_ENV)
            for index, part in enumerate(parts):
                view = memoryview(part).cast("B")
                if stall and index == len(parts) - 1:
                    half = len(view) // 2
                    fh.write(view[:half])
                    os.fsync(fh.fileno())
                    time.sleep(float(stall))
                    view = view[half:]
                    written += half
                fh.write(view)
                written += len(view)
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


def _map_file(path: Path, label: str) -> mmap.mmap | str:
    """The file mapped read-only (MAP_POPULATE: no copy into Python), or why not."""
    try:
        fh = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return f"snapshot file is missing: {label}"
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 12:
            return f"{path.name} is not a kvchat snapshot file (too short)"
        return mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)


@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap | str]:
    """:func:`_map_file` as a context that unmaps on exit."""
    mapped = _map_file(path, str(path))
    try:
        yield mapped
    finally:
        if not isinstance(mapped, str):
            mapped.close()


def _header(mapped: mmap.mmap, magic: bytes, name: str) -> tuple[dict[str, Any], int] | str:
    if mapped[:8] != magic:
        return f"{name} is not a kvchat snapshot file (bad magic)"
    (header_len,) = struct.unpack("<I", mapped[8:12])
    if 12 + header_len > len(mapped):
        return f"snapshot file is truncated ({len(mapped)} bytes)"
    try:
        return json.loads(mapped[12 : 12 + header_len]), 12 + header_len
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "snapshot header is corrupt"


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
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvchat-chunks")
        for path in (directory, self.chunk_dir):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)

    # --- save -----------------------------------------------------------------------------

    def save(self, session_id: str, engine: Engine, fingerprint: Fingerprint) -> SaveResult:
        """Snapshot the context as ``session_id``'s KV, replacing its previous snapshot."""
        tokens = engine.tokens
        state = engine.state_get()
        previous = self.store.get_snapshot(session_id)
        layout = self._parse(engine, state) if self.chunked else None
        if layout is not None:
            result = self._save_chunks(session_id, tokens, state, layout, fingerprint)
        else:
            result = self._save_blob(session_id, tokens, state, fingerprint)
        if previous is not None and previous.format == "blob" and previous.path != result.row.path:
            (self.directory / previous.path).unlink(missing_ok=True)
        self.drop_unreferenced_chunks()
        result.evicted = self.enforce_budget(keep=session_id)
        self.store.bump_counters(bytes_written=result.bytes_written)
        return result

    @staticmethod
    def _parse(engine: Engine, state: memoryview) -> kvlayout.StateLayout | None:
        shape = engine.kv_shape()
        if shape is None:
            return None
        try:
            return kvlayout.parse(state, *shape)
        except kvlayout.LayoutError:
            return None

    def _save_blob(
        self, session_id: str, tokens: list[int], state: memoryview, fingerprint: Fingerprint
    ) -> SaveResult:
        token_bytes = array("i", tokens).tobytes()
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
        written = _write_atomically(
            self.directory / name,
            [MAGIC + struct.pack("<I", len(header)) + header, token_bytes, state],
        )
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
        return SaveResult(row, written)

    def chunk_plan(self, fingerprint: Fingerprint, tokens: list[int], base: list[int]) -> list[tuple[int, int, str]]:
        """(start, end, key) of every chunk of ``tokens``; the key hashes the whole prefix.

        ``base`` lists chunk ends already stored for a prefix of ``tokens`` (the previous
        snapshot's, or the donor's): they are kept, so what a turn appends becomes new
        chunks and nothing stored is rewritten. After them, chunks end on multiples of
        ``chunk_tokens`` (so unrelated sessions cut shared prefixes alike), plus a tail.
        """
        ends = list(base)
        position = ends[-1] if ends else 0
        while position < len(tokens):
            position = min((position // self.chunk_tokens + 1) * self.chunk_tokens, len(tokens))
            ends.append(position)
        h = xxhash.xxh3_128(json.dumps(fingerprint.to_dict(), sort_keys=True).encode())
        token_bytes = array("i", tokens).tobytes()
        plan = []
        start = 0
        for end in ends:
            h.update(token_bytes[start * 4 : end * 4])
            plan.append((start, end, h.copy().hexdigest()))
            start = end
        return plan

    def _base_ends(
        self, session_id: str, tokens: list[int], fingerprint: Fingerprint, n_ctx: int
    ) -> list[int]:
        """Chunk ends of the stored chain sharing the longest prefix with ``tokens``."""
        row = self.store.get_snapshot(session_id)
        if row is None or row.format != "chunks" or row.fingerprint != fingerprint.to_dict():
            donor = self._best_donor(session_id, fingerprint, tokens, n_ctx)
            row = donor[0] if donor else None
        if row is None or row.format != "chunks":
            return []
        shared = common_prefix(row.token_ids, tokens)
        index = self.store.get_chunks(row.chunk_keys)
        ends = []
        for key in row.chunk_keys:
            entry = index.get(key)
            if entry is None or entry.start + entry.n_tokens > shared:
                break
            ends.append(entry.start + entry.n_tokens)
        return ends

    def _save_chunks(
        self,
        session_id: str,
        tokens: list[int],
        state: memoryview,
        layout: kvlayout.StateLayout,
        fingerprint: Fingerprint,
    ) -> SaveResult:
        data = np.frombuffer(state, dtype=np.uint8)
        base = self._base_ends(session_id, tokens, fingerprint, max(len(tokens), 1))
        plan = self.chunk_plan(fingerprint, tokens, base)
        known = self.store.get_chunks([key for _, _, key in plan])
        new_rows: list[ChunkRow] = []
        written = shared = 0
        for start, end, key in plan:
            existing = known.get(key)
            if existing is not None and (self.chunk_dir / existing.path).is_file():
                shared += 1
                continue
            chunk = kvlayout.extract(data, layout, start, end)
            digest = checksum(chunk)
            header = json.dumps(
                {"key": key, "start": start, "n_tokens": end - start, "n_bytes": len(chunk),
                 "checksum": digest},
                sort_keys=True,
            ).encode()
            name = f"{key[:2]}/{key}{CHUNK_SUFFIX}"
            (self.chunk_dir / key[:2]).mkdir(mode=0o700, exist_ok=True)
            written += _write_atomically(
                self.chunk_dir / name,
                [CHUNK_MAGIC + struct.pack("<I", len(header)) + header, chunk],
            )
            new_rows.append(ChunkRow(key, name, start, end - start, len(chunk), digest))
        keys = [key for _, _, key in plan]
        row = SnapshotRow(
            session_id=session_id,
            path="",
            n_tokens=len(tokens),
            token_ids=tokens,
            fingerprint=fingerprint.to_dict(),
            n_bytes=len(state),
            checksum=checksum(json.dumps(keys).encode()),
            format="chunks",
            chunk_keys=keys,
            layout=layout.describe(),
        )
        self.store.put_snapshot(row, new_rows)
        return SaveResult(row, written, chunks_written=len(new_rows), chunks_shared=shared)

    # --- restore --------------------------------------------------------------------------

    def restore(
        self,
        session_id: str,
        engine: Engine,
        fingerprint: Fingerprint,
        prompt: list[int] | None = None,
    ) -> RestoreResult:
        """Load the session's own snapshot; without one, the longest prefix another has.

        Never raises for a bad snapshot: the result carries the reason instead, and the
        context is left empty for a full prefill.
        """
        started = time.perf_counter()
        row = self.store.get_snapshot(session_id)
        if row is None:
            donor = self._best_donor(session_id, fingerprint, prompt, engine.n_ctx)
            if donor is None:
                engine.clear()
                self.store.bump_counters(restore_misses=1)
                return RestoreResult("none", reason="no snapshot saved for this session yet")
            row, keep = donor
        else:
            keep = row.n_tokens
        reason = fingerprint.mismatch(row.fingerprint)
        if reason is None and keep > engine.n_ctx:
            reason = f"snapshot holds {keep} tokens but n_ctx is {engine.n_ctx}"
        if reason is None:
            reason = self._load(row, engine, keep)
        if reason is not None:
            engine.clear()
            self.store.bump_counters(restore_misses=1)
            return RestoreResult("none", reason=reason)
        elapsed = (time.perf_counter() - started) * 1000
        n_bytes = engine.state_size() if keep != row.n_tokens else row.n_bytes
        self.store.touch_snapshot(row.session_id)
        self.store.bump_counters(restores_disk=1, tokens_restored=keep, bytes_restored=n_bytes)
        donor_id = row.session_id if row.session_id != session_id else None
        return RestoreResult("disk", ms=elapsed, bytes=n_bytes, tokens=keep, donor=donor_id)

    def _best_donor(
        self, session_id: str, fingerprint: Fingerprint, prompt: list[int] | None, n_ctx: int
    ) -> tuple[SnapshotRow, int] | None:
        """The chunked snapshot sharing the longest token prefix with ``prompt``."""
        if not prompt:
            return None
        best: tuple[SnapshotRow, int] | None = None
        wanted = fingerprint.to_dict()
        for row in self.store.snapshots():
            if row.session_id == session_id or row.format != "chunks" or row.fingerprint != wanted:
                continue
            shared = min(common_prefix(row.token_ids, prompt), n_ctx)
            if shared >= MIN_DONOR_TOKENS and (best is None or shared > best[1]):
                best = (row, shared)
        return best

    def _load(self, row: SnapshotRow, engine: Engine, keep: int) -> str | None:
        if row.format == "chunks":
            return self._load_chunks(row, engine, keep)
        return self._load_blob(row, engine)

    def _load_blob(self, row: SnapshotRow, engine: Engine) -> str | None:
        """Map, verify and load one blob file; the reason it failed, or None."""
        path = self.directory / row.path
        with _mapped(path) as mapped:
            if isinstance(mapped, str):
                return mapped
            parsed = _header(mapped, MAGIC, path.name)
            if isinstance(parsed, str):
                return parsed
            header, tokens_at = parsed
            state_at = tokens_at + 4 * row.n_tokens
            expected = state_at + row.n_bytes
            if len(mapped) != expected:
                return f"snapshot file is truncated or padded ({len(mapped)} of {expected} bytes)"
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

    def _load_chunks(self, row: SnapshotRow, engine: Engine, keep: int) -> str | None:
        """Verify the chain's chunks covering the first ``keep`` tokens, reassemble, load."""
        if row.layout is None:
            return "chunked snapshot has no layout"
        if row.checksum != checksum(json.dumps(row.chunk_keys).encode()):
            return "snapshot chunk list does not match its index row"
        index = self.store.get_chunks(row.chunk_keys)
        needed: list[tuple[ChunkRow, int]] = []
        covered = 0
        for key in row.chunk_keys:
            if covered >= keep:
                break
            entry = index.get(key)
            if entry is None:
                return f"snapshot chunk {key[:12]} is missing from the index"
            needed.append((entry, covered))
            covered += entry.n_tokens
        out = engine.state_buffer(kvlayout.layout_for(row.layout, keep).total)
        view = np.frombuffer(out, dtype=np.uint8)
        try:
            assembler = kvlayout.Assembler(view, row.layout, keep)
            with _ChunkSet() as chunks:

                def verify_and_place(item: tuple[ChunkRow, int]) -> str | int:
                    entry, start = item
                    data = chunks.open(self.chunk_dir / entry.path, entry, start)
                    return data if isinstance(data, str) else assembler.place(data, start)

                # Two workers: numpy's copies release the GIL, so chunks land in parallel.
                results = list(self._workers.map(verify_and_place, needed))
            bad = [(entry, r) for (entry, _), r in zip(needed, results) if isinstance(r, str)]
            if bad:
                # Forget the broken chunks, so the next save writes them again instead of
                # sharing them; any other chain using them falls back the same way.
                self.store.delete_chunks([entry.key for entry, _ in bad])
                for entry, _ in bad:
                    (self.chunk_dir / entry.path).unlink(missing_ok=True)
                return bad[0][1]
            size = assembler.finish(sum(r for r in results if isinstance(r, int)))
        except kvlayout.LayoutError as exc:
            return f"snapshot chunks do not fit together: {exc}"
        finally:
            del view
        if not engine.state_set(out, size, row.token_ids[:keep]):
            return "llama.cpp rejected the reassembled snapshot state"
        return None

    def files(self, row: SnapshotRow) -> list[Path]:
        """The files holding a snapshot's data."""
        if row.format == "blob":
            return [self.directory / row.path]
        index = self.store.get_chunks(row.chunk_keys)
        return [self.chunk_dir / index[key].path for key in row.chunk_keys if key in index]

    # --- housekeeping ---------------------------------------------------------------------

    def delete(self, session_id: str) -> None:
        """Forget a session's snapshot (its text is untouched)."""
        row = self.store.get_snapshot(session_id)
        self.store.delete_snapshot(session_id)
        if row is not None and row.format == "blob":
            (self.directory / row.path).unlink(missing_ok=True)
        self.drop_unreferenced_chunks()

    def drop_unreferenced_chunks(self) -> int:
        """Delete chunks no snapshot uses any more; returns bytes freed."""
        unused = self.store.unreferenced_chunks()
        if not unused:
            return 0
        self.store.delete_chunks([c.key for c in unused])
        for chunk in unused:
            (self.chunk_dir / chunk.path).unlink(missing_ok=True)
        return sum(c.n_bytes for c in unused)

    def disk_bytes(self) -> int:
        """Bytes of snapshot data on disk (each shared chunk counted once)."""
        blobs = sum(r.n_bytes for r in self.store.snapshots() if r.format == "blob")
        return blobs + sum(c.n_bytes for c in self.store.all_chunks())

    def enforce_budget(self, keep: str | None = None) -> list[str]:
        """Evict least recently used snapshots until the disk budget holds; never text."""
        if self.budget_bytes is None:
            return []
        evicted: list[str] = []
        for row in self.store.snapshots():
            if self.disk_bytes() <= self.budget_bytes:
                break
            if row.session_id == keep:
                continue
            self.delete(row.session_id)
            evicted.append(row.session_id)
        return evicted

    def clear(self, session_id: str | None = None) -> int:
        """Delete one session's snapshot, or all of them; returns how many."""
        rows = self.store.snapshots()
        targets = [r for r in rows if session_id is None or r.session_id == session_id]
        for row in targets:
            self.delete(row.session_id)
        return len(targets)

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and files no row points to."""
        referenced = self.store.snapshot_paths()
        removed: list[str] = []
        now = time.time()
        for entry in _walk(self.directory):
            name = entry.name
            relative = entry.relative_to(self.chunk_dir if entry.parent != self.directory else self.directory)
            if name.endswith(".tmp"):
                pid_text = name.rsplit(".", 2)[-2]
                if pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
                    continue
            elif name.endswith((SUFFIX, CHUNK_SUFFIX)):
                if str(relative) in referenced or now - entry.stat().st_mtime < ORPHAN_GRACE_S:
                    continue
            else:
                continue
            entry.unlink(missing_ok=True)
            removed.append(name)
        return removed


def _walk(directory: Path) -> Iterator[Path]:
    for entry in directory.iterdir():
        if entry.is_dir():
            yield from _walk(entry)
        else:
            yield entry


class _ChunkSet:
    """Maps and verifies chunk files one at a time; unmaps them all on exit."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def __enter__(self) -> _ChunkSet:
        return self

    def __exit__(self, *exc: object) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a view still alive (an exception's frame): GC unmaps it
                pass

    def open(self, path: Path, entry: ChunkRow, start: int) -> np.ndarray | str:
        """The chunk's verified bytes (checksum read leaves them in cache), or why not."""
        mapped = _map_file(path, f"chunk {path.name}")
        if isinstance(mapped, str):
            return mapped
        self._maps.append(mapped)
        parsed = _header(mapped, CHUNK_MAGIC, path.name)
        if isinstance(parsed, str):
            return parsed
        header, data_at = parsed
        if len(mapped) != data_at + entry.n_bytes:
            return f"snapshot chunk {path.name} is truncated or padded"
        if (
            header.get("key") != entry.key
            or header.get("n_bytes") != entry.n_bytes
            or header.get("checksum") != entry.checksum
            or entry.start != start
        ):
            return f"snapshot chunk {path.name} does not match its index row"
        data = np.frombuffer(mapped, dtype=np.uint8, count=entry.n_bytes, offset=data_at)
        if checksum(data) != entry.checksum:
            return f"snapshot chunk checksum mismatch: {path.name} is corrupt"
        return data
