"""The store under faults: damaged files, racing openers, damaged index rows, foreign dirs."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from kvchat import system
from kvchat.errors import KvchatError
from kvchat.paths import ensure_private_dir
from kvchat.store import Store
from kvchat.store.locks import SessionBusy, SessionLocks
from kvchat.store.rows import SnapshotRow, pack_tokens
from kvchat.store.store import DamagedDatabase


def _filled(path: Path, n: int = 200) -> str:
    store = Store(path)
    session = store.create_session("Keep me")
    for i in range(n):
        store.add_message(session.id, "user", f"message {i} " + "x" * 200)
    store.close()
    # Fold the WAL into the main file so that damage to it is damage to the data.
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return session.id


def test_garbage_inside_the_database_is_refused_and_left_alone(tmp_path: Path):
    path = tmp_path / "kvchat.db"
    _filled(path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(os.urandom(8192))
    before = path.read_bytes()
    with pytest.raises(DamagedDatabase) as excinfo:
        Store(path)
    assert "kvchat doctor" in str(excinfo.value) and str(path) in str(excinfo.value)
    assert path.read_bytes() == before  # never written to


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_truncated_or_overwritten_database_is_a_clear_error(tmp_path: Path, damage: str):
    path = tmp_path / "kvchat.db"
    _filled(path)
    if damage == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 3)
    else:
        path.write_bytes(b"this is not a database " * 400)
    before = path.read_bytes()
    with pytest.raises(DamagedDatabase):
        Store(path)
    assert path.read_bytes() == before


def _open_new_home(path: str, results: multiprocessing.Queue) -> None:
    try:
        store = Store(Path(path))
        store.create_session("racer")
        store.close()
        results.put("ok")
    except Exception as exc:  # reported to the parent, which asserts on it
        results.put(f"{type(exc).__name__}: {exc}")


def test_processes_opening_a_new_home_at_once_all_succeed(tmp_path: Path):
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(3):
        path = tmp_path / f"home{attempt}" / "kvchat.db"
        results: multiprocessing.Queue = ctx.Queue()
        procs = [ctx.Process(target=_open_new_home, args=(str(path), results)) for _ in range(6)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["ok"] * len(procs)
        db = sqlite3.connect(path)
        assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == len(procs)
        names = [n for (n,) in db.execute("SELECT name FROM _migrations")]
        assert len(names) == len(set(names))


def test_copy_session_is_one_transaction(tmp_path: Path):
    store = Store(tmp_path / "kvchat.db")
    parent = store.create_session("Parent", "be brief", {"temperature": 0.1})
    ids = [
        store.add_message(parent.id, r, f"m{i}").id for i, r in enumerate(["user", "assistant"] * 3)
    ]
    child = store.copy_session(parent.id, "Child", upto_message=ids[2], then=("user", "edited", 2))
    assert [m.content for m in store.messages(child.id)] == ["m0", "m1", "m2", "edited"]
    assert child.system_prompt == "be brief" and child.settings == {"temperature": 0.1}

    # A failure half-way (here: a constraint violation in the appended message) leaves nothing.
    before = len(store.list_sessions())
    with pytest.raises(sqlite3.IntegrityError):
        store.copy_session(parent.id, "Broken", then=("user", None, 0))  # type: ignore[arg-type]
    assert len(store.list_sessions()) == before


def _snapshot_row(**changes) -> dict:
    row = {
        "session_id": "abcd1234",
        "path": "x.kvs",
        "n_tokens": 3,
        "token_ids": pack_tokens([1, 2, 3]),
        "fingerprint": json.dumps({"model_id": "m"}),
        "n_bytes": 100,
        "checksum": "c",
        "created": "",
        "last_used": "",
        "format": "chunks",
        "chunk_keys": json.dumps(["k1"]),
        "layout": json.dumps({"k": []}),
    }
    row.update(changes)
    return row


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"token_ids": b"\x01\x02\x03\x04\x05"}, "not whole tokens"),
        ({"n_tokens": -1}, "does not match"),
        ({"fingerprint": "[1, 2]"}, "fingerprint is not a JSON object"),
        ({"fingerprint": "{not json"}, "fingerprint is not valid JSON"),
        ({"chunk_keys": '{"a": 1}'}, "chunk_keys is not a JSON list"),
        ({"chunk_keys": "[1, 2]"}, "not a list of keys"),
        ({"layout": "[]"}, "layout is not a JSON object"),
        ({"n_bytes": -5}, "negative"),
        ({"format": "weird"}, "unknown snapshot format"),
        ({"path": 7}, "path is not str"),
    ],
)
def test_a_damaged_snapshot_row_reads_with_its_reason(changes: dict, reason: str):
    row = SnapshotRow.from_row(_snapshot_row(**changes))
    assert row.damage is not None and reason in row.damage


def test_a_sound_snapshot_row_has_no_damage():
    row = SnapshotRow.from_row(_snapshot_row())
    assert row.damage is None and row.token_ids == [1, 2, 3] and row.chunk_keys == ["k1"]


def test_an_existing_shared_directory_keeps_its_mode(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    ensure_private_dir(shared)
    Store(shared / "kvchat.db").close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    made = ensure_private_dir(tmp_path / "new" / "deeper")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((shared / "kvchat.db").stat().st_mode) == 0o600


@pytest.fixture(params=system.NAMES)
def os_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each of kvchat.system's implementations in turn (also in processes started here)."""
    monkeypatch.setenv(system.PLATFORM_ENV, request.param)
    yield system.use(request.param)
    monkeypatch.delenv(system.PLATFORM_ENV)  # before use(None), or it would choose it again
    system.use(None)


def _hold_then_report(directory: str, session_id: str, ready, release) -> None:
    with SessionLocks(Path(directory)).hold(session_id):
        ready.set()
        release.wait(30)


def test_a_session_lock_held_elsewhere_says_which_process(tmp_path: Path, os_calls):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_then_report, args=(str(tmp_path), "abcd1234", ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        locks = SessionLocks(tmp_path)
        with pytest.raises(SessionBusy) as excinfo:
            with locks.hold("abcd1234", wait_s=0.2):
                pass
        assert f"process {holder.pid}" in str(excinfo.value)
        with locks.hold("ffff0000", wait_s=0.2):  # another session is free
            pass
    finally:
        release.set()
        holder.join(30)
    with SessionLocks(tmp_path).hold("abcd1234", wait_s=1):  # free once the holder ends
        pass


def test_lock_names_come_from_session_ids_only(tmp_path: Path):
    with pytest.raises(KvchatError):
        SessionLocks(tmp_path).path("../../etc/passwd")


def test_doctor_salvages_the_text_and_keeps_the_damaged_file(tmp_path: Path):
    from kvchat.store import integrity as doctor

    path = tmp_path / "kvchat.db"
    session_id = _filled(path, n=400)
    # Garbage over two of the messages table's pages in the middle of it (found by SQLite's
    # page map, not by the file's middle: which pages lie there depends on the schema).
    db = sqlite3.connect(path)
    pages = [
        row[0]
        for row in db.execute(
            "SELECT pageno FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf'"
            " ORDER BY pageno"
        )
    ]
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(path, "r+b") as fh:
        for page in pages[len(pages) // 2 : len(pages) // 2 + 2]:
            fh.seek((page - 1) * page_size)
            fh.write(os.urandom(page_size))
    damaged = path.read_bytes()
    assert not doctor.check(path).ok
    report = doctor.salvage(path)
    assert report.moved_to.read_bytes() == damaged  # moved aside, untouched
    assert report.sessions == 1 and 0 < report.messages < 400  # the broken pages are lost
    store = Store(path)
    texts = [m.content for m in store.messages(session_id)]
    assert len(texts) == report.messages and texts[0].startswith("message 0 ")
    assert doctor.check(path).ok


def test_a_turn_lock_holds_when_a_full_disk_refuses_its_holder_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import errno

    from kvchat.store import locks as locks_module

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    locks = SessionLocks(tmp_path / "locks")
    with monkeypatch.context() as patch:
        patch.setattr(locks_module.os, "pwrite", full)
        with locks.hold("0123abcd", 0):
            with pytest.raises(SessionBusy):  # the lock is held all the same
                with SessionLocks(tmp_path / "locks").hold("0123abcd", 0):
                    pass
    with locks.hold("0123abcd", 0):  # and let go
        pass


def test_sqlite_disk_io_error_on_a_full_disk_is_named_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from kvchat.store import connection as base
    from kvchat.store.store import StoreFull

    error = sqlite3.OperationalError("disk I/O error")
    assert type(base._translate(tmp_path / "kvchat.db", error)) is KvchatError  # room left
    monkeypatch.setattr(base, "disk_full", lambda _directory: True)
    translated = base._translate(tmp_path / "kvchat.db", error)
    assert isinstance(translated, StoreFull)
    assert str(translated).startswith("the disk is full: could not write to")
