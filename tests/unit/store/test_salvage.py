"""Salvage reads what SQLite cannot walk: a file cut in half, a damaged
header, damaged pages. Every message salvaged is the one written, never garbage."""

from __future__ import annotations

import os
import random
import sqlite3
from pathlib import Path

import pytest

from kvchat.store import Store
from kvchat.store import integrity as doctor

N_SESSIONS = 41


def _home(path: Path) -> dict[int, str]:
    """41 sessions, 804 messages of varied length (some spill to overflow pages), folded
    into the main file; returns every message's text by id."""
    store = Store(path)
    texts: dict[int, str] = {}
    for j in range(N_SESSIONS):
        session = store.create_session(f"Session {j}")
        for i in range(20 if j < N_SESSIONS - 1 else 4):
            text = f"message {j}.{i} " + "lorem ipsum " * (20 + (i * 37) % 400)
            message = store.add_message(session.id, ("user", "assistant")[i % 2], text)
            texts[message.id] = text
    # A reply rewritten as it streamed: only its last version may come back.
    streamed = store.add_message(session.id, "assistant", "draft " * 900, partial=True)
    for n in (1000, 1200):
        store.update_message(streamed.id, "draft " * n, True)
    texts[streamed.id] = "final answer"
    store.update_message(streamed.id, "final answer", False)
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return texts


def _salvaged(path: Path) -> dict[int, tuple[str, str]]:
    store = Store(path)
    try:
        rows = store._rows("SELECT id, session_id, content FROM messages")
        return {r["id"]: (r["session_id"], r["content"]) for r in rows}
    finally:
        store.close()


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "half":
        del data[len(data) // 2 :]
    elif how == "header":
        data[:100] = bytes(100)
    elif how == "pages":
        rng = random.Random(20)
        for page in rng.sample(range(2, len(data) // 4096), 20):
            data[page * 4096 : (page + 1) * 4096] = os.urandom(4096)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("how", "at_least"), [("half", 300), ("header", 805), ("pages", 700)])
def test_salvage_reads_the_pages_sqlite_cannot_walk(tmp_path: Path, how: str, at_least: int):
    path = tmp_path / "kvchat.db"
    texts = _home(path)
    _damage(path, how)
    assert not doctor.check(path).ok

    report = doctor.salvage(path)

    salvaged = _salvaged(path)
    assert report.messages == len(salvaged) >= at_least
    # Every session a salvaged message belongs to is there (its row, or one made for it).
    # Cut in half, which sessions keep messages depends on where SQLite put the pages (a
    # schema with more tables moves them); otherwise every session is found.
    assert report.sessions == len({session for session, _ in salvaged.values()})
    if how != "half":
        assert report.sessions == N_SESSIONS
    for message_id, (_, content) in salvaged.items():
        assert content == texts[message_id]  # the text written (its last version), no garbage
    tables = report.tables
    assert set(tables) == {"sessions", "messages"}
    counted = tables["messages"].read + tables["messages"].recovered
    assert counted == len(salvaged)
    if how == "half":
        assert tables["messages"].recovered > 0
        session_rows = tables["sessions"].read + tables["sessions"].recovered
        if session_rows == N_SESSIONS:
            assert tables["messages"].lost == len(texts) - len(salvaged)  # by their counts
        else:  # the rows that count their messages are gone too: each such session is said
            said = [line for line in report.lost if "its row is lost" in line]
            assert len(said) == report.sessions - session_rows
            # ... and the count of lost messages does not pass for the whole of it.
            assert "an unknown number more" in tables["messages"].line("messages")
    for table, counts in tables.items():
        assert counts.line(table).startswith(f"{table}: ")
    # Messages lost uncounted exactly where a session's row (which counts them) was lost.
    rows_lost = any("its row is lost" in line for line in report.lost)
    assert ("an unknown number more" in tables["messages"].line("messages")) == rows_lost
    assert doctor.check(path).ok


def test_messages_whose_session_row_is_lost_are_kept_under_a_recovered_session(
    tmp_path: Path,
):
    path = tmp_path / "kvchat.db"
    store = Store(path)
    session = store.create_session("Lost title")
    store.add_message(session.id, "user", "keep this text")
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name='sessions'").fetchone()
    db.close()
    data = bytearray(path.read_bytes())
    data[(root - 1) * 4096 : root * 4096] = bytes(4096)  # the sessions table's only page
    path.write_bytes(bytes(data))

    report = doctor.salvage(path)

    assert report.messages == 1
    store = Store(path)
    try:
        [recovered] = store.list_sessions()
        assert recovered.session.id == session.id and recovered.session.title.startswith(
            "Recovered"
        )
        assert [m.content for m in store.messages(session.id)] == ["keep this text"]
    finally:
        store.close()
