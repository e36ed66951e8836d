"""Model-free unit tests of the snapshot modules: files, format, chunk planning,
housekeeping, and SnapshotStore's blob path with a fake engine."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvchat.engine import EngineCapabilities
from kvchat.kvcache import SnapshotRejected, SnapshotStore
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chains import chunk_plan
from kvchat.kvcache.cold.files import map_file, mapped, temp_writer_alive, write_atomically
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.store import ChunkRow, SnapshotRow, Store
from tests.stand_in_engine import EngineDefaults

FP = Fingerprint("id0", "m.gguf", "0.3", "f16", "f16", False, 10000.0, 1.0, 0, 30)


def test_write_atomically_leaves_a_private_file_and_no_temp(tmp_path: Path) -> None:
    final = tmp_path / "a.kvs"
    assert write_atomically(final, [b"abc", memoryview(b"defg")]) == 7
    assert final.read_bytes() == b"abcdefg"
    assert final.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["a.kvs"]


def test_write_atomically_removes_its_temp_on_failure(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomically(tmp_path / "a.kvs", [b"abc", object()])
    assert list(tmp_path.iterdir()) == []


def test_map_file_rejects_missing_and_short_files(tmp_path: Path) -> None:
    with pytest.raises(SnapshotRejected, match="snapshot file is missing: x"):
        map_file(tmp_path / "nope", "x")
    short = tmp_path / "short.kvs"
    short.write_bytes(b"KVCSNAP1")
    with pytest.raises(SnapshotRejected, match="not a kvchat snapshot file"):
        map_file(short, "short")


def test_temp_writer_alive() -> None:
    assert not temp_writer_alive(f"a.kvs.{os.getpid()}.tmp")  # ours: a leftover
    assert not temp_writer_alive("a.kvs.999999999.tmp")  # no such process
    assert temp_writer_alive(f"a.kvs.{os.getppid()}.tmp")
    assert not temp_writer_alive("a.kvs.x.tmp")


def blob_file(tmp_path: Path, tokens: list[int], state: bytes) -> tuple[Path, SnapshotRow]:
    parts, digest = fmt.blob_parts("0123abcd", FP.to_dict(), tokens, memoryview(state))
    path = tmp_path / fmt.blob_name("0123abcd")
    write_atomically(path, parts)
    row = SnapshotRow("0123abcd", path.name, len(tokens), tokens, FP.to_dict(), len(state), digest)
    return path, row


def test_blob_round_trip_and_rejections(tmp_path: Path) -> None:
    path, row = blob_file(tmp_path, [1, 2, 3], bytes(range(200)))
    with mapped(path) as mapping:
        state = fmt.read_blob(mapping, row, path.name)
        assert bytes(state) == bytes(range(200))
        del state
    other = SnapshotRow(**{**row.__dict__, "token_ids": [1, 2, 4]})
    with mapped(path) as mapping, pytest.raises(SnapshotRejected, match="token ids do not match"):
        fmt.read_blob(mapping, other, path.name)
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    with mapped(path) as mapping, pytest.raises(SnapshotRejected, match="checksum mismatch"):
        fmt.read_blob(mapping, row, path.name)
    path.write_bytes(bytes(data[:-10]))
    with mapped(path) as mapping, pytest.raises(SnapshotRejected, match="truncated or padded"):
        fmt.read_blob(mapping, row, path.name)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"GGUF" + bytes(100), "bad magic"),
        (fmt.MAGIC + (1000).to_bytes(4, "little") + b"{}", "truncated"),
        (fmt.MAGIC + (4).to_bytes(4, "little") + b"{{{{", "header is corrupt"),
        (fmt.MAGIC + (6).to_bytes(4, "little") + b"[1, 2]", "not a JSON object"),
    ],
)
def test_read_header_rejects(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "f.kvs"
    path.write_bytes(content)
    with mapped(path) as mapping, pytest.raises(SnapshotRejected, match=reason):
        fmt.read_header(mapping, fmt.MAGIC, path.name)


def test_chunk_round_trip_checks_its_row(tmp_path: Path) -> None:
    chunk = np.arange(64, dtype=np.uint8)
    parts, digest = fmt.chunk_parts("ab" * 16, 32, 40, chunk)
    path = tmp_path / "c.kvc"
    write_atomically(path, parts)
    entry = ChunkRow("ab" * 16, "c.kvc", 32, 8, 64, digest)
    with mapped(path) as mapping:
        data = fmt.read_chunk(mapping, entry, 32, path.name)
        assert bytes(data) == bytes(range(64))
        del data
        with pytest.raises(SnapshotRejected, match="does not match its index row"):
            fmt.read_chunk(mapping, entry, 0, path.name)


def test_chunk_plan_keeps_base_cuts_and_shares_prefix_keys() -> None:
    tokens = list(range(100))
    plan = chunk_plan(FP, tokens, [], 32)
    assert [(s, e) for s, e, _ in plan] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    longer = chunk_plan(FP, tokens + [7] * 10, [32, 64, 96, 100], 32)
    assert [(s, e) for s, e, _ in longer] == [(0, 32), (32, 64), (64, 96), (96, 100), (100, 110)]
    assert [k for *_, k in longer[:4]] == [k for *_, k in plan]
    other = Fingerprint(**{**FP.to_dict(), "type_k": "q8_0"})
    assert chunk_plan(other, tokens, [], 32)[0][2] != plan[0][2]


class FakeEngine(EngineDefaults):
    """Just enough of an engine for blob snapshots (kv_shape None: no layout)."""

    # The whole-state path: a synthetic state can't be appended piece by piece.
    capabilities = EngineCapabilities(seq_state=True)

    def __init__(self, tokens: list[int], state: bytes, n_ctx: int = 1024) -> None:
        self.tokens = tokens
        self.state = state
        self.n_ctx = n_ctx
        self.loaded: bytes | None = None

    def state_get(self) -> memoryview:
        return memoryview(self.state)

    def kv_shape(self) -> None:
        return None

    def state_set(self, pointer: object, n_bytes: int, tokens: list[int]) -> bool:
        self.loaded = ctypes.string_at(pointer, n_bytes)
        return True

    def state_size(self) -> int:
        return len(self.state)

    def clear(self) -> None:
        self.loaded = None


def test_store_restores_a_blob_and_reports_rejections(tmp_path: Path) -> None:
    store = Store(tmp_path / "kv.db")
    session = store.create_session("t").id
    snapshots = SnapshotStore(tmp_path / "snapshots", store, chunked=False)
    engine = FakeEngine([5, 6, 7], bytes(range(256)) * 4)
    saved = snapshots.save(session, engine, FP)
    assert saved.row.format == "blob" and snapshots.disk_bytes() == 1024
    result = snapshots.restore(session, engine, FP)
    assert (result.source, result.tokens, engine.loaded) == ("disk", 3, engine.state)
    small = FakeEngine([], b"", n_ctx=2)
    assert "n_ctx is 2" in (snapshots.restore(session, small, FP).reason or "")
    (path,) = snapshots.files(saved.row)
    path.unlink()
    result = snapshots.restore(session, engine, FP)
    assert result.source == "none" and "snapshot file is missing" in (result.reason or "")
    assert snapshots.clear() == 1 and snapshots.disk_bytes() == 0


def test_cleanup_orphans_spares_young_and_live_files(tmp_path: Path) -> None:
    snapshots = SnapshotStore(tmp_path / "snapshots", Store(tmp_path / "kv.db"))
    old = snapshots.directory / "deadbeef-1.kvs"
    young = snapshots.directory / "deadbeef-2.kvs"
    torn = snapshots.directory / "deadbeef-3.kvs.999999999.tmp"
    live = snapshots.directory / f"deadbeef-4.kvs.{os.getppid()}.tmp"
    for path in (old, young, torn, live):
        path.write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert sorted(snapshots.cleanup_orphans()) == sorted([old.name, torn.name])
    assert sorted(p.name for p in snapshots.directory.iterdir() if p.is_file()) == sorted(
        [young.name, live.name]
    )
