"""`kvchat doctor` checks a damaged database and salvages what it holds into a new one, in
one clear line per finding; the real `kvchat` CLI and real SQLite."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from tests.e2e.locks.test_session_lock import assert_user_error

# --- 5. kvchat doctor ------------------------------------------------------------------------


def _verdict(stdout: str) -> str:
    """Doctor's line about the database (after its engine-probe and crash sections)."""
    return next((x for x in stdout.splitlines() if x.startswith(("ok ", "damaged: "))), "")


def test_doctor_checks_and_salvages_a_damaged_database(kvhome: Path, cli):
    assert _verdict(cli(kvhome, "doctor").stdout).startswith("ok (no database yet")
    service = ChatService(Settings())
    session = service.sessions.new_session(title="Keep me")
    for i in range(300):
        role = "user" if i % 2 == 0 else "assistant"
        service.sessions.add_message(session.id, role, f"padding {i} " + "y" * 300)
    service.close()
    healthy = cli(kvhome, "doctor")
    assert _verdict(healthy.stdout).startswith("ok (1 sessions, 300 messages)"), healthy.stdout
    db = sqlite3.connect(kvhome / "kvchat.db")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    path = kvhome / "kvchat.db"
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        fh.write(b"\xa5" * 8192)
    damaged = path.read_bytes()

    result = cli(kvhome, "doctor", check=False)
    assert _verdict(result.stdout).startswith("damaged: ")
    assert_user_error(result, "kvchat doctor --salvage")
    for args in (["list"], ["export", session.id], ["cache"]):
        assert_user_error(cli(kvhome, *args, check=False), "kvchat doctor")
    assert path.read_bytes() == damaged

    fixed = cli(kvhome, "doctor", "--salvage")
    assert _verdict(fixed.stdout).startswith("damaged: ")
    assert "\nsalvaged 1 sessions, " in fixed.stdout
    assert "the damaged file is kept at " in fixed.stdout and "unreadable rows" in fixed.stdout
    aside = [
        p
        for p in kvhome.iterdir()
        if p.name.startswith("kvchat.db.damaged-") and not p.name.endswith(("-wal", "-shm"))
    ]
    assert [p.read_bytes() for p in aside] == [damaged]
    assert _verdict(cli(kvhome, "doctor").stdout).startswith("ok (1 sessions, ")
    assert [s["title"] for s in cli(kvhome, "list", "--json").json] == ["Keep me"]
