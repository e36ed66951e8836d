"""What the snapshot code may touch and how it fails, model-free: file names derive from
keys, never from the database; kvchat deletes only files it wrote, never follows or chmods
a directory it did not make; a damaged row or file is a fallback with a reason for its own
session only and `cache gc` removes it; a row is bound to its tokens; chunk keys include
their start; the disk budget says what it did. The end-to-end versions are
tests/e2e/resume/test_snapshot_safety.py."""

from __future__ import annotations

import ctypes
import json
import os
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvchat import system
from kvchat.engine import EngineCapabilities
from kvchat.kvcache import SnapshotStore
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chains import KEYS_MISMATCH, chain_keys, chunk_plan, verify_chain
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.rejected import SnapshotRejected, SnapshotsUnavailable
from kvchat.store import Store
from tests.stand_in_engine import EngineDefaults

FP = Fingerprint("id0", "m.gguf", "0.3", "f16", "f16", False, 10000.0, 1.0, 0, 2)
N_LAYER, WIDTH = 2, 4


def seq_state(n_cells: int, seed: int) -> bytes:
    """A single-stream seq state in llama.cpp's layout (f16 K and V rows, V not transposed)."""
    rng = np.random.default_rng(seed)
    out = bytearray(struct.pack("<QII", 0x5EED, 1, n_cells))
    for pos in range(n_cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", 0, N_LAYER)
    row = WIDTH * 2
    for _ in range(2 * N_LAYER):  # K of every layer, then V of every layer
        out += struct.pack("<iQ", 1, row) + rng.bytes(row * n_cells)
    return bytes(out)


class FakeEngine(EngineDefaults):
    """Enough of an engine for both snapshot formats (``chunked``: a parseable state)."""

    # The whole-state path: a synthetic state can't be appended piece by piece.
    capabilities = EngineCapabilities(seq_state=True)

    def __init__(self, tokens: list[int], *, chunked: bool = True, seed: int = 0) -> None:
        self.tokens = tokens
        self.state = seq_state(len(tokens), seed)
        self.chunked = chunked
        self.n_ctx = 4096
        self.loaded: bytes | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def state_get(self) -> memoryview:
        return memoryview(self.state)

    def kv_shape(self) -> tuple[int, int, int] | None:
        return (N_LAYER, WIDTH, WIDTH) if self.chunked else None

    def state_buffer(self, size: int) -> bytearray:
        return bytearray(size)

    def state_set(self, buf: Any, n_bytes: int, tokens: list[int]) -> bool:
        if isinstance(buf, bytearray):
            self.loaded = bytes(buf[:n_bytes])
        else:
            self.loaded = ctypes.string_at(buf, n_bytes)
        return True

    def state_size(self) -> int:
        return len(self.state)

    def clear(self) -> None:
        self.loaded = None


def tokens_of(seed: int, n: int = 40) -> list[int]:
    return [1000 * seed + i for i in range(n)]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def open_store(home: Path, **kwargs: Any) -> tuple[Store, SnapshotStore]:
    store = Store(home / "kvchat.db")
    return store, SnapshotStore(home / "snapshots", store, chunk_tokens=16, **kwargs)


def saved_sessions(
    home: Path, n: int = 2, *, chunked: bool = True, **kwargs: Any
) -> tuple[Store, SnapshotStore, list[str]]:
    """``n`` sessions, each with a saved snapshot of 40 tokens of its own."""
    store, snapshots = open_store(home, chunked=chunked, **kwargs)
    sessions = []
    for index in range(n):
        session = store.create_session(f"s{index}").id
        snapshots.save(session, FakeEngine(tokens_of(index), chunked=chunked, seed=index), FP)
        sessions.append(session)
    return store, snapshots, sessions


def restore(snapshots: SnapshotStore, session: str, seed: int) -> tuple[Any, FakeEngine]:
    engine = FakeEngine(tokens_of(seed), seed=seed)
    return snapshots.restore(session, engine, FP), engine


def sql(home: Path, statement: str, *params: object) -> None:
    db = sqlite3.connect(home / "kvchat.db")
    with db:
        db.execute(statement, params)
    db.close()


def tree(directory: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``directory`` (not following links) with its mode and content."""
    found = {}
    for path in [directory, *directory.rglob("*")]:
        info = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        found[str(path.relative_to(directory))] = (info.st_mode, content)
    return found


def age(path: Path, seconds: float = 3600) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


# --- item 2: files stay ours ---------------------------------------------------------------


def test_chunked_round_trip_with_the_fake_engine(home: Path) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    for seed, session in enumerate((a, b)):
        result, engine = restore(snapshots, session, seed)
        assert (result.source, result.tokens) == ("disk", 40)
        assert engine.loaded == engine.state
    assert store.get_snapshot(a).format == "chunks"


@pytest.mark.parametrize("chunked", [False, True], ids=["blob", "chunks"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_stored_path_outside_is_never_opened_or_deleted(
    home: Path, tmp_path: Path, chunked: bool, where: str
) -> None:
    store, snapshots, (a, b) = saved_sessions(home, chunked=chunked)
    victim = tmp_path / "victim.kvs"
    victim.write_bytes(b"the user's file")
    age(victim)
    name = "../../victim.kvs" if where == "relative" else str(victim)
    if chunked:
        key = store.get_snapshot(a).chunk_keys[-1]
        sql(home, "UPDATE kv_chunks SET path=? WHERE key=?", name, key)
    else:
        sql(home, "UPDATE kv_snapshots SET path=? WHERE session_id=?", name, a)

    result, _ = restore(snapshots, a, 0)
    assert result.source == "none"
    assert "names a file that is not its own" in result.reason
    assert restore(snapshots, b, 1)[0].source == "disk"  # the other session is unharmed
    # Saving over it, gc, deleting and clearing: none of them goes near the victim.
    snapshots.save(a, FakeEngine(tokens_of(0) + [7, 8], chunked=chunked), FP)
    snapshots.cleanup_orphans()
    snapshots.drop_damaged()
    snapshots.enforce_budget()
    snapshots.delete(a)
    snapshots.clear()
    assert victim.read_bytes() == b"the user's file"


def test_a_damaged_path_row_is_dropped_by_gc_without_deleting_anything(
    home: Path, tmp_path: Path
) -> None:
    store, snapshots, (a, b) = saved_sessions(home, chunked=False)
    victim = tmp_path / "victim.kvs"
    victim.write_bytes(b"x")
    sql(home, "UPDATE kv_snapshots SET path=? WHERE session_id=?", str(victim), a)
    assert a in snapshots.drop_damaged()
    assert store.get_snapshot(a) is None and store.get_snapshot(b) is not None
    assert victim.exists()
    result, _ = restore(snapshots, a, 0)
    assert "removed as damaged" in result.reason and "not its own" in result.reason


@pytest.mark.parametrize("which", ["snapshots", "chunks"])
def test_a_symlinked_snapshot_dir_disables_snapshots_and_touches_nothing(
    home: Path, tmp_path: Path, which: str
) -> None:
    user = tmp_path / "user-folder"
    user.mkdir()
    os.chmod(user, 0o755)
    for name in (
        "notes.tmp",
        "report.kvs",
        "deadbeef-1.kvs",
        "deadbeef-1.kvs.999999999.tmp",
        "0123abcd-ff.kvs",
    ):
        (user / name).write_bytes(b"mine")
        age(user / name)
    (user / "ab").mkdir()
    (user / "ab" / ("ab" * 16 + ".kvc")).write_bytes(b"mine")
    age(user / "ab" / ("ab" * 16 + ".kvc"))
    before = tree(user)
    home.mkdir()
    if which == "snapshots":
        (home / "snapshots").symlink_to(user)
    else:
        (home / "snapshots").mkdir()
        (home / "snapshots" / "chunks").symlink_to(user)

    store, snapshots = open_store(home)
    assert snapshots.disabled is not None and "symbolic link" in snapshots.disabled
    session = store.create_session("t").id
    with pytest.raises(SnapshotsUnavailable, match="snapshots are disabled"):
        snapshots.save(session, FakeEngine(tokens_of(0)), FP)
    with pytest.raises(OSError):  # what the tiers catch: the turn goes on without a snapshot
        snapshots.save(session, FakeEngine(tokens_of(0), chunked=False), FP)
    result, _ = restore(snapshots, session, 0)
    assert result.source == "none" and "snapshots are disabled" in result.reason
    assert snapshots.cleanup_orphans() == []
    snapshots.drop_damaged()
    snapshots.enforce_budget()
    snapshots.clear()
    assert snapshots.disk_stats()["disabled"] == snapshots.disabled
    assert tree(user) == before  # nothing deleted, nothing chmod-ed


def test_a_file_in_place_of_the_snapshot_dir_disables_snapshots(home: Path) -> None:
    home.mkdir()
    (home / "snapshots").write_bytes(b"not a directory")
    store, snapshots = open_store(home)
    assert "not a directory" in (snapshots.disabled or "")
    assert snapshots.cleanup_orphans() == []
    assert (home / "snapshots").read_bytes() == b"not a directory"


def test_an_existing_snapshot_dir_is_never_chmod_ed(home: Path) -> None:
    (home / "snapshots").mkdir(parents=True)
    os.chmod(home / "snapshots", 0o1777)
    _, snapshots = open_store(home)
    assert snapshots.disabled is None
    assert (home / "snapshots").stat().st_mode & 0o7777 == 0o1777
    assert (home / "snapshots" / "chunks").stat().st_mode & 0o777 == 0o700  # made by kvchat


def test_orphan_cleanup_removes_only_files_named_as_ours(home: Path, tmp_path: Path) -> None:
    store, snapshots, (a,) = saved_sessions(home, n=1)
    directory = home / "snapshots"
    outside = tmp_path / "outside.kvs"
    outside.write_bytes(b"x")
    age(outside)
    key = "cd" * 16
    strays = {
        "notes.txt": "file",
        "report.kvs": "file",  # a .kvs, but not a name kvchat gives
        "deadbeef-1.kvs.tmp": "file",  # no pid
        "other.999999999.tmp": "file",  # dead pid, but not our name
        "deadbeef-2.kvs": "dir",  # our name, but a directory
        "deadbeef-3.kvs": "link",  # our name, but a symlink out
        "chunks/zz": "dir",
        f"chunks/ab/{key}.kvc": "file",  # a chunk name in the wrong subdirectory
        f"chunks/{key[:2]}/{key}.kvc.tmp": "file",
        "chunks/cd/readme": "file",
        "chunks/ef": "link",
    }
    for name, kind in strays.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_bytes(b"x")
        elif kind == "dir":
            path.mkdir()
        else:
            path.symlink_to(outside if name.endswith(".kvs") else tmp_path)
        age(path)
    ours = {
        "deadbeef-4.kvs": "orphan blob",
        "deadbeef-5.kvs.999999999.tmp": "dead writer's temp",
        f"chunks/{key[:2]}/{key}.kvc": "orphan chunk",
        f"chunks/{key[:2]}/{key}.kvc.999999999.tmp": "dead writer's temp",
    }
    for name in ours:
        (directory / name).write_bytes(b"x")
        age(directory / name)
    live = directory / f"deadbeef-6.kvs.{os.getppid()}.tmp"
    live.write_bytes(b"x")
    young = directory / "deadbeef-7.kvs"
    young.write_bytes(b"x")

    removed = snapshots.cleanup_orphans()
    assert sorted(removed) == sorted(Path(name).name for name in ours)
    for name in strays:
        assert os.path.lexists(directory / name), name
    assert outside.exists() and live.exists() and young.exists()
    assert restore(snapshots, a, 0)[0].source == "disk"  # referenced files are kept


# --- item 3: damaged rows and files fail their own session only ------------------------------


def damage_token_ids(home: Path, session: str) -> str:
    sql(home, "UPDATE kv_snapshots SET token_ids=? WHERE session_id=?", b"\0" * 7, session)
    return "not whole tokens"


def damage_fingerprint(home: Path, session: str) -> str:
    sql(home, "UPDATE kv_snapshots SET fingerprint='[1, 2]' WHERE session_id=?", session)
    return "fingerprint is not a JSON object"


def damage_fingerprint_field(home: Path, session: str) -> str:
    sql(
        home,
        "UPDATE kv_snapshots SET fingerprint=json_set(fingerprint, '$.rope_freq_base', 'x')"
        " WHERE session_id=?",
        session,
    )
    return "fingerprint is damaged"


def damage_n_tokens(home: Path, session: str) -> str:
    sql(home, "UPDATE kv_snapshots SET n_tokens=-1 WHERE session_id=?", session)
    return "n_tokens -1"


def damage_layout(home: Path, session: str) -> str:
    sql(
        home,
        "UPDATE kv_snapshots SET layout=json_remove(layout, '$.k') WHERE session_id=?",
        session,
    )
    return "layout has no 'k'"


def damage_layout_sizes(home: Path, session: str) -> str:
    sql(
        home,
        "UPDATE kv_snapshots SET layout=json_set(layout, '$.k[0][1]', 1 << 40) WHERE session_id=?",
        session,
    )
    return "layout"


def damage_format(home: Path, session: str) -> str:
    sql(home, "UPDATE kv_snapshots SET format='zip' WHERE session_id=?", session)
    return "unknown snapshot format"


def damage_chunk_path_to_a_dir(home: Path, session: str) -> str:
    db = sqlite3.connect(home / "kvchat.db")
    (keys,) = db.execute(
        "SELECT chunk_keys FROM kv_snapshots WHERE session_id=?", (session,)
    ).fetchone()
    db.close()
    key = json.loads(keys)[-1]
    sql(home, "UPDATE kv_chunks SET path=? WHERE key=?", key[:2], key)
    return "not its own"


@pytest.mark.parametrize(
    "damage",
    [
        damage_token_ids,
        damage_fingerprint,
        damage_fingerprint_field,
        damage_n_tokens,
        damage_layout,
        damage_layout_sizes,
        damage_format,
        damage_chunk_path_to_a_dir,
    ],
)
def test_a_damaged_row_fails_only_its_own_session_and_gc_removes_it(home: Path, damage) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    reason = damage(home, a)
    # Listing and figures over every row: no exception.
    assert len(store.snapshots()) == 2
    assert snapshots.disk_bytes() > 0
    stats = snapshots.disk_stats()
    assert stats["damaged"] == 1
    snapshots.over_budget_note()
    result, engine = restore(snapshots, a, 0)
    assert result.source == "none" and engine.loaded is None
    assert reason in result.reason
    # Another session's turn: restore, save (which enforces the budget), restore again.
    result, engine = restore(snapshots, b, 1)
    assert result.source == "disk" and engine.loaded == engine.state
    snapshots.save(b, FakeEngine(tokens_of(1) + [1, 2, 3], seed=5), FP)
    assert restore(snapshots, b, 1)[0].source == "disk"
    # cache gc: the damaged row goes, with its reason kept for its session's next turn.
    snapshots.cleanup_orphans()
    snapshots.drop_unreferenced_chunks()
    snapshots.enforce_budget()
    assert store.get_snapshot(a) is None and store.get_snapshot(b) is not None
    assert snapshots.disk_stats()["damaged"] == 0
    assert "removed as damaged" in restore(snapshots, a, 0)[0].reason
    # And the session saves and resumes again.
    snapshots.save(a, FakeEngine(tokens_of(0)), FP)
    assert restore(snapshots, a, 0)[0].source == "disk"


def test_a_chunk_file_replaced_by_a_directory_falls_back(home: Path) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    key = store.get_snapshot(a).chunk_keys[-1]
    path = home / "snapshots" / "chunks" / fmt.chunk_name(key)
    path.unlink()
    path.mkdir()
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and "not a regular file" in result.reason
    assert restore(snapshots, b, 1)[0].source == "disk"
    snapshots.cleanup_orphans()
    snapshots.enforce_budget()
    assert path.is_dir()  # not ours to delete
    with pytest.raises(OSError, match="in the way"):  # a clear line, never a traceback
        snapshots.save(a, FakeEngine(tokens_of(0)), FP)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"3"])
def test_a_header_that_is_json_but_not_an_object_falls_back(home: Path, header: bytes) -> None:
    store, snapshots, (a, b) = saved_sessions(home, chunked=False)
    (path,) = snapshots.files(store.get_snapshot(a))
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    path.write_bytes(data[:8] + struct.pack("<I", len(header)) + header + data[12 + length :])
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and "not a JSON object" in result.reason
    assert restore(snapshots, b, 1)[0].source == "disk"


@pytest.fixture(params=system.NAMES)
def os_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each of kvchat.system's implementations in turn (also in processes started here)."""
    monkeypatch.setenv(system.PLATFORM_ENV, request.param)
    yield system.use(request.param)
    monkeypatch.delenv(system.PLATFORM_ENV)  # before use(None), or it would choose it again
    system.use(None)


def test_a_symlinked_chunk_file_is_not_followed(
    home: Path, tmp_path: Path, os_calls: system.System
) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    key = store.get_snapshot(a).chunk_keys[0]
    path = home / "snapshots" / "chunks" / fmt.chunk_name(key)
    copy = tmp_path / "elsewhere.kvc"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and "symbolic link" in result.reason
    snapshots.delete(a)
    snapshots.cleanup_orphans()
    assert copy.exists()


def test_a_symlinked_chunk_subdirectory_is_not_followed(
    home: Path, tmp_path: Path, os_calls: system.System
) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    key = store.get_snapshot(a).chunk_keys[0]
    subdir = home / "snapshots" / "chunks" / key[:2]
    elsewhere = tmp_path / "elsewhere"
    subdir.rename(elsewhere)
    os.chmod(elsewhere, 0o755)
    subdir.symlink_to(elsewhere)
    before = tree(elsewhere)
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and "symbolic link" in result.reason
    with pytest.raises(OSError, match="symbolic link"):
        snapshots.save(a, FakeEngine(tokens_of(0)), FP)
    for name in os.listdir(elsewhere):
        age(elsewhere / name)
    snapshots.cleanup_orphans()
    snapshots.enforce_budget()
    snapshots.clear()
    after = tree(elsewhere)
    assert after.keys() == before.keys() and after["."][0] == before["."][0]


# --- item 8: a row is bound to its tokens ----------------------------------------------------


def test_swapped_chunk_keys_fall_back_instead_of_loading_another_sessions_kv(home: Path) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    keys = store.get_snapshot(b).chunk_keys
    sql(
        home,
        "UPDATE kv_snapshots SET chunk_keys=?, checksum=? WHERE session_id=?",
        json.dumps(keys),
        fmt.chain_checksum(keys),
        a,
    )
    result, engine = restore(snapshots, a, 0)
    assert result.source == "none" and engine.loaded is None
    assert result.reason == KEYS_MISMATCH
    assert restore(snapshots, b, 1)[0].source == "disk"
    assert a in snapshots.drop_damaged()
    assert store.get_snapshot(b) is not None


@pytest.mark.parametrize("value", [b"", b"\x01\x02"], ids=repr)
def test_a_chunk_checksum_of_another_type_falls_back(home: Path, value: bytes) -> None:
    """A damaged index can hold a BLOB in a chunk's checksum (its TEXT column makes numbers
    text, not bytes): the restore falls back with the reason (the stress damage campaign
    found one raising TypeError)."""
    store, snapshots, (a, b) = saved_sessions(home)
    key = store.get_snapshot(a).chunk_keys[0]
    sql(home, "UPDATE kv_chunks SET checksum=? WHERE key=?", value, key)
    result, engine = restore(snapshots, a, 0)
    assert result.source == "none" and engine.loaded is None
    assert "damaged checksum" in result.reason
    assert restore(snapshots, b, 1)[0].source in ("disk", "none")


def test_edited_tokens_or_fingerprint_unbind_the_chain(home: Path) -> None:
    store, snapshots, (a,) = saved_sessions(home, n=1)
    row = store.get_snapshot(a)
    index = store.get_chunks(row.chunk_keys)
    assert len(verify_chain(row, index, row.n_tokens)) == 3
    row.token_ids = [*row.token_ids[:-1], 99999]
    with pytest.raises(SnapshotRejected, match="chunk keys do not match"):
        verify_chain(row, index, row.n_tokens)
    row = store.get_snapshot(a)
    row.fingerprint = {**row.fingerprint, "model_file": "other.gguf"}
    with pytest.raises(SnapshotRejected, match="chunk keys do not match"):
        verify_chain(row, index, row.n_tokens)


# --- item 9: chunk keys include the chunk's start --------------------------------------------


def old_keys(tokens: list[int], ends: list[int]) -> list[str]:
    """The keys of the old scheme: the fingerprint and the tokens up to the end, no start."""
    h = xxhash.xxh3_128(json.dumps(FP.to_dict(), sort_keys=True).encode())
    ids = fmt.token_bytes(tokens)
    keys, start = [], 0
    for end in ends:
        h.update(ids[start * 4 : end * 4])
        keys.append(h.copy().hexdigest())
        start = end
    return keys


def test_chunks_ending_alike_but_starting_elsewhere_have_different_keys() -> None:
    tokens = list(range(128))
    plain = chunk_plan(FP, tokens, [], 64)  # (0, 64), (64, 128)
    recut = chunk_plan(FP, tokens, [64, 103], 64)  # (0, 64), (64, 103), (103, 128)
    assert plain[0] == recut[0]
    assert plain[1][1] == recut[2][1] == 128
    assert plain[1][2] != recut[2][2]
    assert len({key for *_, key in plain + recut}) == 4
    assert chain_keys(FP.to_dict(), tokens, [64, 128]) == [key for *_, key in plain]


def test_a_chunk_row_used_at_another_start_is_rejected(home: Path) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    key = store.get_snapshot(a).chunk_keys[1]  # tokens 16..32
    sql(home, "UPDATE kv_chunks SET start=20, n_tokens=12 WHERE key=?", key)
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and "the chain uses it at 16" in result.reason
    # The next save of a's tokens cuts its own chain and never shares the mislabelled row.
    saved = snapshots.save(a, FakeEngine(tokens_of(0)), FP)
    assert saved.chunks_written >= 1
    result, engine = restore(snapshots, a, 0)
    assert result.source == "disk" and engine.loaded == engine.state


def test_rows_of_the_old_key_scheme_fall_back_and_gc_removes_them(home: Path) -> None:
    store, snapshots, (a, b) = saved_sessions(home)
    row = store.get_snapshot(a)
    index = store.get_chunks(row.chunk_keys)
    ends = [index[k].start + index[k].n_tokens for k in row.chunk_keys]
    # Rewrite a's chain as the old scheme wrote it: same data, keys without the start.
    chunk_dir = home / "snapshots" / "chunks"
    olds = old_keys(row.token_ids, ends)
    for new, old in zip(row.chunk_keys, olds):
        data = (chunk_dir / fmt.chunk_name(new)).read_bytes()
        target = chunk_dir / fmt.chunk_name(old)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(data)
        entry = index[new]
        sql(
            home,
            "INSERT INTO kv_chunks (key, path, start, n_tokens, n_bytes, checksum)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            old,
            fmt.chunk_name(old),
            entry.start,
            entry.n_tokens,
            entry.n_bytes,
            entry.checksum,
        )
    sql(
        home,
        "UPDATE kv_snapshots SET chunk_keys=?, checksum=? WHERE session_id=?",
        json.dumps(olds),
        fmt.chain_checksum(olds),
        a,
    )
    snapshots.drop_unreferenced_chunks()  # a's new-scheme chunks: nobody uses them now
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none" and result.reason == KEYS_MISMATCH
    snapshots.enforce_budget()  # the gc pass
    assert store.get_snapshot(a) is None
    assert not set(olds) & {c.key for c in store.all_chunks()}
    assert not any((chunk_dir / fmt.chunk_name(k)).exists() for k in olds)
    assert restore(snapshots, b, 1)[0].source == "disk"


# --- item 11: the disk budget ---------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunks", "blob"])
def test_an_evicted_session_says_it_was_evicted(home: Path, chunked: bool) -> None:
    one = len(seq_state(40, 0))
    budget = int(1.5 * one)
    store, snapshots, (a, b) = saved_sessions(home, chunked=chunked, budget_bytes=budget)
    assert store.get_snapshot(a) is None and store.get_snapshot(b) is not None
    result, _ = restore(snapshots, a, 0)
    assert result.source == "none"
    assert result.reason.startswith("its snapshot was evicted to keep the disk budget (")
    assert "GiB)" in result.reason
    assert snapshots.over_budget_note() is None
    # Saved again, it resumes; and the old reason is gone once a snapshot exists.
    snapshots.save(a, FakeEngine(tokens_of(0), chunked=chunked), FP)
    assert restore(snapshots, a, 0)[0].source == "disk"
    snapshots.clear(a)
    assert restore(snapshots, a, 0)[0].reason == "no snapshot saved for this session yet"


def test_a_budget_smaller_than_the_open_sessions_snapshot_is_reported(home: Path) -> None:
    store, snapshots = open_store(home, budget_bytes=1000)
    session = store.create_session("t").id
    saved = snapshots.save(session, FakeEngine(tokens_of(0)), FP)
    assert store.get_snapshot(session) is not None  # kept: its session is in use
    note = snapshots.over_budget_note()
    assert note is not None and f"session {session}" in note
    assert "larger than the disk budget" in note
    assert saved.over_budget == note
    assert snapshots.disk_stats()["over_budget"] == note
    store2, unlimited = open_store(home / "other")
    assert unlimited.over_budget_note() is None


# --- random damage: never a wrong restore, never an exception ----------------------------------

COLUMNS = {
    "kv_snapshots": [
        "path", "n_tokens", "token_ids", "fingerprint", "n_bytes", "checksum", "format",
        "chunk_keys", "layout",
    ],
    "kv_chunks": ["key", "path", "start", "n_tokens", "n_bytes", "checksum"],
}  # fmt: skip
ODD = [None, -1, 0, 3, 2**40, "", "../x", "/etc/passwd", "{}", "[]", "[1]", '{"k": 1}',
       b"\x01\x02\x03", b"", "garbage", 1.5, "chunks", "blob", "ab"]  # fmt: skip


class RecordingEngine(FakeEngine):
    """Remembers the tokens the loaded state was labelled with."""

    labelled: list[int] | None = None

    def state_set(self, buf: Any, n_bytes: int, tokens: list[int]) -> bool:
        self.labelled = list(tokens)
        return super().state_set(buf, n_bytes, tokens)


@pytest.mark.parametrize("seed", range(4))
def test_random_row_edits_never_restore_wrong_kv_nor_raise(tmp_path: Path, seed: int) -> None:
    import random

    rng = random.Random(seed)
    states = {tuple(tokens_of(i)): seq_state(40, i) for i in range(3)}
    for case in range(40):
        home = tmp_path / f"case{case}"
        chunked = rng.random() < 0.7
        store, snapshots, sessions = saved_sessions(home, n=3, chunked=chunked)
        db = sqlite3.connect(home / "kvchat.db")
        for _ in range(rng.choice([1, 2, 3])):
            table = rng.choice(list(COLUMNS))
            rowids = [r for (r,) in db.execute(f"SELECT rowid FROM {table}")]
            if not rowids:
                continue
            rowid, column = rng.choice(rowids), rng.choice(COLUMNS[table])
            others = db.execute(f"SELECT {column} FROM {table} WHERE rowid != ?", (rowid,))
            pool = [v for (v,) in others] if rng.random() < 0.5 else ODD
            try:
                with db:
                    db.execute(
                        f"UPDATE {table} SET {column}=? WHERE rowid=?", (rng.choice(pool), rowid)
                    )
            except sqlite3.IntegrityError:
                pass
        db.close()
        store.snapshots()
        snapshots.disk_stats()
        for index, session in enumerate(sessions):
            engine = RecordingEngine(tokens_of(index), chunked=chunked, seed=index)
            result = snapshots.restore(session, engine, FP)
            if result.source == "disk":
                # Whatever was loaded is exactly the KV of the tokens it was labelled with.
                assert engine.loaded == states[tuple(engine.labelled)][: len(engine.loaded)]
                assert engine.labelled == tokens_of(index), (case, session)
            else:
                assert result.reason
        snapshots.cleanup_orphans()
        snapshots.drop_unreferenced_chunks()
        snapshots.enforce_budget()
        assert snapshots.disk_stats()["damaged"] == 0
        for index, session in enumerate(sessions):
            try:
                snapshots.save(session, RecordingEngine(tokens_of(index), seed=index), FP)
            except OSError as exc:  # a file in the way: reported, never a traceback
                assert "in the way" in str(exc)
                continue
            engine = RecordingEngine(tokens_of(index), seed=index)
            again = snapshots.restore(session, engine, FP)
            assert again.source == "disk", (case, again.reason)
            assert engine.loaded == engine.state
