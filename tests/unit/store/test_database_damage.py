"""Damage the open check misses: a damaged index, a WAL on a damaged file, an empty
database file. Real SQLite files, damaged byte by byte."""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store
from kvchat.store import store as store_module
from kvchat.store.store import DamagedDatabase


def _home(path: Path, n: int = 6) -> tuple[str, str]:
    """A database with a session of ``n`` messages and another, folded into the main file;
    returns (the session's id, the other's)."""
    store = Store(path)
    other = store.create_session("Other")
    store.add_message(other.id, "user", "hello", token_count=2)
    session = store.create_session("Six")
    for i in range(n):
        store.add_message(session.id, ("user", "assistant")[i % 2], f"m{i}", token_count=5)
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return session.id, other.id


def damage_index(path: Path, index: str, session_id: str) -> None:
    """Flip one bit of the session id in every entry of ``index`` (its root page): the
    table keeps its rows, the index points elsewhere; quick_check does not see it."""
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (index,)).fetchone()
    db.close()
    data = bytearray(path.read_bytes())
    at = (root - 1) * page_size
    page = bytes(data[at : at + page_size])
    sid = session_id.encode()
    assert sid in page
    data[at : at + page_size] = page.replace(sid, bytes([sid[0] ^ 1]) + sid[1:])
    path.write_bytes(bytes(data))
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    assert db.execute("PRAGMA integrity_check").fetchall() != [("ok",)]
    db.close()


def _files(path: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for suffix in ("", "-wal"):
        side = path.with_name(path.name + suffix)
        out[suffix] = side.read_bytes() if side.exists() else None
    return out


def _no_index_checks_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big file's open checks the session list's table and compares the messages' index
    with the session rows' counts (issue 37 item 7): off, as for damage those miss."""
    monkeypatch.setattr(store_module, "OPEN_CHECK_TABLES", ())
    monkeypatch.setattr(Store, "_message_index_agrees", lambda self: True)


@pytest.fixture
def background_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file counts as big, and the damage is one the checks at open miss: the full
    check runs in the background (writes wait for its verdict)."""
    monkeypatch.setattr(store_module, "FULL_CHECK_AT_OPEN_BYTES", 0)
    _no_index_checks_at_open(monkeypatch)


def test_a_damaged_message_index_is_caught_at_open(tmp_path: Path):
    path = tmp_path / "kvchat.db"
    session_id, _ = _home(path)
    damage_index(path, "idx_messages_session_id_id", session_id)
    before = _files(path)
    with pytest.raises(DamagedDatabase, match="kvchat doctor"):
        Store(path)
    assert _files(path) == before


def test_a_history_its_index_hides_is_damage_not_a_short_history(tmp_path, background_check):
    path = tmp_path / "kvchat.db"
    session_id, other_id = _home(path)
    damage_index(path, "idx_messages_session_id_id", session_id)
    before = _files(path)
    store = Store(path)  # the quick check passes
    try:
        with pytest.raises(DamagedDatabase) as excinfo:
            store.messages(session_id)
        line = str(excinfo.value)
        assert "records 6 messages" in line and "kvchat doctor" in line and "\n" not in line
        # What the app reads of a session (a page, a window) checks the same index.
        for read in (store.messages_page, store.message_window):
            with pytest.raises(DamagedDatabase, match="records 6 messages"):
                read(session_id, 5)
        with pytest.raises(DamagedDatabase):
            store.add_message(session_id, "user", "lost?")
        # Nothing more is written anywhere, and the full check confirms the damage.
        with pytest.raises(DamagedDatabase):
            store.add_message(other_id, "user", "elsewhere")
        assert store.wait_for_check(30) is not None
    finally:
        store.close()
    assert _files(path) == before


def test_the_background_check_stops_writes_it_did_not_see_coming(tmp_path, background_check):
    path = tmp_path / "kvchat.db"
    session_id, other_id = _home(path)
    damage_index(path, "idx_messages_session_id_id", session_id)
    store = Store(path)
    try:
        assert store.wait_for_check(30) is not None
        # The other session reads whole (or, when the damaged entries now sort across its
        # own, as damage), but the file is damaged: no writes anywhere.
        try:
            assert [m.content for m in store.messages(other_id)] == ["hello"]
        except DamagedDatabase:
            pass
        with pytest.raises(DamagedDatabase, match="kvchat doctor"):
            store.add_message(other_id, "user", "more")
        with pytest.raises(DamagedDatabase):
            store.create_session("new")
    finally:
        store.close()


def test_a_session_its_id_index_hides_is_named_damage(tmp_path, background_check, monkeypatch):
    path = tmp_path / "kvchat.db"
    session_id, _ = _home(path)
    damage_index(path, "sqlite_autoindex_sessions_1", session_id)
    # A big file's open checks the session list's table and indexes (issue 37 item 7)...
    monkeypatch.setattr(store_module, "OPEN_CHECK_TABLES", ("sessions",))
    with pytest.raises(DamagedDatabase, match="sqlite_autoindex_sessions_1"):
        Store(path)
    # ...and where that check could not run (SQLite before 3.33), the reads name it.
    monkeypatch.setattr(store_module, "OPEN_CHECK_TABLES", ())
    store = Store(path)
    try:
        for find in (store.get_session, store.resolve_session):
            with pytest.raises(DamagedDatabase, match="kvchat doctor"):
                find(session_id)
        with pytest.raises(KvchatError, match="no session matches"):
            store.resolve_session("ffffffff")  # an id that is really not there
    finally:
        store.close()


def test_counts_follow_every_write(tmp_path: Path):
    store = Store(tmp_path / "kvchat.db")
    session = store.create_session("S")
    ids = [store.add_message(session.id, "user", f"m{i}", token_count=i).id for i in range(4)]
    store.update_message(ids[1], "longer", False, token_count=10)
    store.delete_message(ids[3])
    child = store.copy_session(session.id, "C", upto_message=ids[1], then=("user", "x", 7))
    assert [m.content for m in store.messages(session.id)] == ["m0", "longer", "m2"]
    assert [m.content for m in store.messages(child.id)] == ["m0", "longer", "x"]
    summary = {s.session.id: (s.messages, s.tokens) for s in store.list_sessions()}
    assert summary == {session.id: (3, 12), child.id: (3, 17)}
    store.close()


def test_a_damaged_database_is_opened_read_only_and_its_wal_kept(tmp_path: Path):
    """A WAL holding the last writes, and damage in the main file: the open check must not
    checkpoint the WAL into the file (nor remove it)."""
    source = tmp_path / "live.db"
    session_id, _ = _home(source, n=200)
    writer = sqlite3.connect(source)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    with writer:
        writer.execute(
            "INSERT INTO messages (session_id, role, content, created) VALUES (?, ?, ?, ?)",
            (session_id, "user", "only in the WAL", "2026-01-01"),
        )
    path = tmp_path / "kvchat.db"
    for suffix in ("", "-wal", "-shm"):  # a copy while the writer has it open: WAL kept
        shutil.copyfile(source.with_name(source.name + suffix), path.with_name(path.name + suffix))
    writer.close()
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(os.urandom(4096))
    before = _files(path)
    assert before["-wal"]
    with pytest.raises(DamagedDatabase):
        Store(path)
    assert _files(path) == before


def test_damage_found_after_open_leaves_the_wal_alone(tmp_path, background_check):
    source = tmp_path / "live.db"
    session_id, other_id = _home(source)
    damage_index(source, "idx_messages_session_id_id", session_id)
    writer = sqlite3.connect(source)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    with writer:
        writer.execute("UPDATE sessions SET title='renamed' WHERE id=?", (other_id,))
    path = tmp_path / "kvchat.db"
    for suffix in ("", "-wal", "-shm"):
        shutil.copyfile(source.with_name(source.name + suffix), path.with_name(path.name + suffix))
    writer.close()
    before = _files(path)
    assert before["-wal"]
    store = Store(path)
    assert store.wait_for_check(30) is not None
    store.close()
    assert _files(path) == before


def test_an_empty_database_file_is_kept_aside_and_said(tmp_path: Path):
    path = tmp_path / "kvchat.db"
    path.touch(mode=0o600)
    with pytest.raises(KvchatError) as excinfo:
        Store(path)
    line = str(excinfo.value)
    assert "empty (0 bytes" in line and "kept aside" in line and "\n" not in line
    [aside] = tmp_path.glob("kvchat.db.empty-*")
    assert aside.stat().st_size == 0 and not path.exists()
    Store(path).close()  # the next open starts a new database
    assert path.stat().st_size > 0


def test_a_new_database_appears_whole(tmp_path: Path):
    """A new home's database is built under another name and renamed: never a 0-byte
    kvchat.db that a kill mid-creation leaves (which would read as a lost database)."""
    path = tmp_path / "kvchat.db"
    store = Store(path)
    assert store.applied_migrations and path.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir() if ".new-" in p.name) == []
    store.close()


def test_closing_stops_a_background_check_that_starts_after_it(tmp_path, monkeypatch):
    """A short command on a big file (``kvchat list``) closes the store while its background
    check is still opening its connection: that check stops at its first step, instead of
    reading the whole file (up to 5 s) before the command may end."""
    _home(tmp_path / "kvchat.db")
    monkeypatch.setattr(store_module, "FULL_CHECK_AT_OPEN_BYTES", 0)
    monkeypatch.setattr(store_module, "CHECK_STEPS", 1)
    opening, go = threading.Event(), threading.Event()
    real_connection = store_module.check_connection

    def held(path: Path, timeout: float = 30) -> sqlite3.Connection:
        conn = real_connection(path, timeout)
        if threading.current_thread().name == "kvchat-integrity-check":
            opening.set()
            go.wait(10)
        return conn

    monkeypatch.setattr(store_module, "check_connection", held)
    outcomes: list[str] = []
    real_pragma = Store._pragma_ok

    def pragma(self: Store, check: str) -> bool:
        try:
            ok = real_pragma(self, check)
        except sqlite3.OperationalError as exc:
            outcomes.append(str(exc))
            raise
        outcomes.append("ran whole")
        return ok

    monkeypatch.setattr(Store, "_pragma_ok", pragma)
    store = Store(tmp_path / "kvchat.db")
    assert opening.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)  # close() has asked the check to stop and waits for it
    go.set()
    closer.join(10)
    assert not closer.is_alive() and outcomes == ["interrupted"], outcomes


def test_reads_do_not_wait_for_the_check_that_gates_writes(tmp_path, monkeypatch):
    """A big file's quick_check gates writes, not reads: while it runs, what the app's first
    paint reads (the session list and the open session's last page, with its last reply's
    version) comes back at once. The first paint at 10,000 conversations waited ~0.3-0.5 s
    for the check in the reply's version."""
    session_id, _ = _home(tmp_path / "kvchat.db")
    monkeypatch.setattr(store_module, "FULL_CHECK_AT_OPEN_BYTES", 0)
    checking, go = threading.Event(), threading.Event()
    real_pragma = Store._pragma_ok

    def held(self: Store, check: str) -> bool:
        checking.set()
        go.wait(10)
        return real_pragma(self, check)

    monkeypatch.setattr(Store, "_pragma_ok", held)
    store = Store(tmp_path / "kvchat.db")
    try:
        assert checking.wait(10)
        read: list[object] = []
        reader = threading.Thread(
            target=lambda: read.extend(
                [
                    len(store.list_sessions_page(50).sessions),
                    [m.content for m in store.message_window(session_id, 2).messages],
                    store.version_of(store.message_window(session_id, 1).messages[-1].id),
                ]
            )
        )
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a read waited for the integrity check"
        assert read == [2, ["m4", "m5"], (1, 1)]
    finally:
        go.set()
        store.close()
