"""A database over 16 MiB with a damaged index: no write goes in before the full check's verdict.

Such a file opens without SQLite's full check (that runs in the background), and writes
waited only for ``quick_check``, which does not compare an index with its table: an import
went in (101 → 102 sessions) and ``list`` said nothing. Now a big file's open checks the
session list's table and indexes and compares the messages' index with the counts each
session row records, and every write waits for the full check's verdict.
"""

from __future__ import annotations

import os
import sqlite3
import struct
from pathlib import Path

import pytest

from kvchat.store import Store
from kvchat.store import store as store_module
from kvchat.store.store import DamagedDatabase

N_SESSIONS = 101
WORDS = "the cat sat on a mat and rain fell over hills while dogs ran far".split()


def _big_home(path: Path) -> list[str]:
    """101 sessions of 40 messages (~5 KB each): a file over 16 MiB, folded into one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Store(path).close()
    db = sqlite3.connect(path)
    ids = [f"{i:08x}" for i in range(N_SESSIONS)]
    with db:
        for i, sid in enumerate(ids):
            db.execute(
                "INSERT INTO sessions (id, title, settings, created, updated) VALUES (?,?,?,?,?)",
                (sid, f"Session {i}", "{}", "2026-01-01T00:00:00", f"2026-01-01T00:{i % 60:02d}"),
            )
            text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1250))
            db.executemany(
                "INSERT INTO messages (session_id, role, content, created, token_count)"
                " VALUES (?, ?, ?, ?, ?)",
                [(sid, ("user", "assistant")[j % 2], text, "2026-01-01", 9) for j in range(40)],
            )
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    assert path.stat().st_size > store_module.FULL_CHECK_AT_OPEN_BYTES
    return ids


def _index_leaf(data: bytes, page_size: int, root: int) -> int:
    """The offset of ``root``'s first leaf page (an index b-tree)."""
    at = (root - 1) * page_size
    while data[at] == 0x02:  # an interior index page: follow its first cell's child
        (pointer,) = struct.unpack_from(">H", data, at + 12)
        (child,) = struct.unpack_from(">I", data, at + pointer)
        at = (child - 1) * page_size
    assert data[at] == 0x0A, "not an index leaf page"
    return at


def damage_index(path: Path, index: str, ids: list[str]) -> None:
    """Flip one bit of a session id in every entry of one leaf page of ``index``: the table
    keeps its rows, the index points elsewhere; quick_check does not see it."""
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (index,)).fetchone()
    db.close()
    data = bytearray(path.read_bytes())
    at = _index_leaf(bytes(data), page_size, root)
    page = bytes(data[at : at + page_size])
    sid = next(s.encode() for s in ids if s.encode() in page)
    data[at : at + page_size] = page.replace(sid, bytes([sid[0] ^ 1]) + sid[1:])
    path.write_bytes(bytes(data))
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    assert db.execute("PRAGMA integrity_check").fetchall() != [("ok",)]
    db.close()


def _sessions(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT count(*) FROM sessions NOT INDEXED").fetchone()[0]
    finally:
        db.close()


def _files(path: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for suffix in ("", "-wal"):
        side = path.with_name(path.name + suffix)
        out[suffix] = side.read_bytes() if side.exists() else None
    return out


@pytest.fixture(scope="module")
def big_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], Path]:
    """A big home (not damaged), and one of its sessions exported as kvchat JSON."""
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("big")
    home = root / "home"
    ids = _big_home(home / "kvchat.db")
    exported = root / "one.json"
    run_cli(home, "export", ids[5], "--format", "json", "-o", str(exported))
    return home, ids, exported


def _copy(home: Path, target: Path) -> Path:
    target.mkdir(mode=0o700)
    (target / "kvchat.db").write_bytes((home / "kvchat.db").read_bytes())
    os.chmod(target / "kvchat.db", 0o600)
    return target


@pytest.mark.e2e
@pytest.mark.parametrize("index", ["idx_messages_session_id_id", "sqlite_autoindex_sessions_1"])
def test_an_import_into_a_big_database_with_a_damaged_index_is_refused(
    big_home, cli, tmp_path, index
):
    source, ids, exported = big_home
    home = _copy(source, tmp_path / "home")
    path = home / "kvchat.db"
    damage_index(path, index, ids)
    before = _files(path)
    for args in (["import", str(exported)], ["list"]):
        result = cli(home, *args, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args, result.stderr)
        assert "damaged" in lines[0] and "kvchat doctor" in lines[0], lines
    assert _sessions(path) == N_SESSIONS
    assert _files(path) == before


@pytest.mark.e2e
def test_a_big_healthy_database_takes_the_import(big_home, cli, tmp_path):
    source, _, exported = big_home
    home = _copy(source, tmp_path / "home")
    cli(home, "import", str(exported))
    result = cli(home, "list", "--all")
    assert result.returncode == 0 and "damaged" not in result.stderr
    assert _sessions(home / "kvchat.db") == N_SESSIONS + 1


def test_writes_wait_for_the_full_checks_verdict(big_home, tmp_path, monkeypatch):
    """Damage the checks at open miss (here: switched off) is found by the full check in
    the background before any write lands; reads go on meanwhile."""
    source, ids, _ = big_home
    path = _copy(source, tmp_path / "home") / "kvchat.db"
    damage_index(path, "idx_messages_session_id_id", ids)
    monkeypatch.setattr(store_module, "OPEN_CHECK_TABLES", (), raising=False)
    monkeypatch.setattr(Store, "_message_index_agrees", lambda self: True, raising=False)
    before = _files(path)
    store = Store(path)  # opens: the full check runs in the background
    try:
        assert len(store.list_sessions_page(10).sessions) == 10  # reads do not wait
        with pytest.raises(DamagedDatabase, match="kvchat doctor"):
            store.create_session("new")  # waits for the verdict, and is refused
        with pytest.raises(DamagedDatabase):
            store.add_message(ids[0], "user", "more")
    finally:
        store.close()
    assert _sessions(path) == N_SESSIONS
    assert _files(path) == before


def test_a_write_after_an_unfinished_check_is_refused(big_home, tmp_path, monkeypatch):
    """A check stopped before its verdict (the store closing) lets no write through."""
    source, _, _ = big_home
    path = _copy(source, tmp_path / "home") / "kvchat.db"
    monkeypatch.setattr(
        Store,
        "_pragma_ok",
        lambda self, check: (_ for _ in ()).throw(sqlite3.OperationalError("interrupted")),
    )
    store = Store(path)
    try:
        assert store.wait_for_check(30) is None
        with pytest.raises(Exception, match="nothing was written"):
            store.create_session("new")
    finally:
        store.close()
    assert _sessions(path) == N_SESSIONS
