"""Crashes leave the database and snapshot files consistent; the user's message is never lost."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.kvcache.cold.snapshot_store import STALL_ENV
from kvchat.service.chat import ChatService
from tests.conftest import FAST, REPO, SNAPSHOT_FORMATS, clean_env


def snapshot_files(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in (home / "snapshots").rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("fmt", "sig"),
    [
        ("chunks", signal.SIGKILL),
        ("blob", signal.SIGKILL),
        # A native crash (what llama.cpp's faults are) mid-write: the same guarantees.
        ("chunks", signal.SIGSEGV),
    ],
)
def test_kill_during_snapshot_write_leaves_session_resumable(
    turn_homes, copy_home, cli, fmt, sig, own_probe_file
):
    source, first = turn_homes(fmt)
    home = copy_home(source, "killed")
    session = first["session"]
    db = sqlite3.connect(home / "kvchat.db")
    (old_tokens,) = db.execute("SELECT n_tokens FROM kv_snapshots").fetchone()
    db.close()
    old_files = snapshot_files(home)
    env = clean_env()
    env.update({"KVCHAT_HOME": str(home), STALL_ENV: "60", **SNAPSHOT_FORMATS[fmt]})
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "ask", "--session", session, "And then?", "--json", *FAST],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not any(name.endswith(".tmp") for name in snapshot_files(home)):
        assert proc.poll() is None, "kvchat exited before writing its snapshot"
        assert time.monotonic() < deadline, "no snapshot write started"
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(sig)
    assert proc.wait() == -sig

    db = sqlite3.connect(home / "kvchat.db")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("SELECT n_tokens FROM kv_snapshots").fetchone()[0] == old_tokens
    roles = [r for (r,) in db.execute("SELECT role FROM messages ORDER BY id")]
    db.close()
    assert roles == ["user", "assistant", "user", "assistant"]  # the reply was committed first

    resumed = cli(
        home, "ask", "--session", session, "Why?", "--json", *FAST, env=SNAPSHOT_FORMATS[fmt]
    ).json
    assert resumed["restore"]["from"] == "disk"
    assert resumed["restore"]["tokens"] == old_tokens
    assert resumed["tokens"]["reused"] == old_tokens
    names = snapshot_files(home)
    assert not [n for n in names if n.endswith(".tmp")], names  # the torn write was cleaned up
    db = sqlite3.connect(home / "kvchat.db")
    referenced = {
        f"snapshots/{p}" for (p,) in db.execute("SELECT path FROM kv_snapshots WHERE format='blob'")
    }
    referenced |= {f"snapshots/chunks/{p}" for (p,) in db.execute("SELECT path FROM kv_chunks")}
    assert names == referenced  # every file is indexed, every index row has its file
    if fmt == "blob":
        assert not old_files & names  # the old blob was replaced


def test_user_message_is_durable_when_generation_crashes(kvhome: Path):
    service = ChatService(Settings(temperature=0, max_tokens=24, n_ctx=1024))
    session = service.sessions.new_session()

    def crash(_piece: str) -> None:
        raise RuntimeError("the UI died mid-reply")

    with pytest.raises(RuntimeError):
        service.send(session.id, "Write a haiku about tea.", on_token=crash)
    # The process dies here: nothing is closed and no snapshot is saved.

    reopened = ChatService(Settings())
    messages = reopened.sessions.messages(session.id)
    assert [(m.role, m.content) for m in messages] == [("user", "Write a haiku about tea.")]
    reopened.close()


def test_cancel_keeps_the_partial_reply_marked_and_resumes_hot(kvhome: Path):
    service = ChatService(Settings(temperature=0, max_tokens=64, n_ctx=1024))
    session = service.sessions.new_session()
    pieces: list[str] = []
    report = service.send(
        session.id,
        "Count from one to twenty in words.",
        on_token=pieces.append,
        cancel=lambda: len(pieces) >= 5,
    )
    assert report.finish_reason == "cancelled"
    assert report.tokens.generated == 5
    stored = service.sessions.messages(session.id)[-1]
    assert stored.role == "assistant" and stored.partial and stored.content == report.reply
    assert report.snapshot.bytes > 0

    follow = service.send(session.id, "Go on.")
    assert follow.restore.source == "hot"
    assert follow.tokens.reused == follow.restore.tokens
    assert follow.tokens.decoded < 32
    service.close()


def test_regenerate_reuses_the_whole_prompt(kvhome: Path):
    service = ChatService(Settings(temperature=0, max_tokens=16, n_ctx=1024))
    session = service.sessions.new_session()
    first = service.send(session.id, "Name a colour.")
    again = service.regenerate(session.id)
    assert again.restore.source == "hot"
    assert again.tokens.decoded == 2  # never one token alone (see Engine.prefill)
    assert again.tokens.reused == again.tokens.prompt - 2
    assert again.reply == first.reply  # greedy: the same reply again
    assert [m.role for m in service.sessions.messages(session.id)] == ["user", "assistant"]
    service.close()


def test_orphans_are_removed_and_referenced_files_kept(turn_homes, copy_home, monkeypatch):
    home = copy_home(turn_homes("blob")[0], "orphans")
    snapshots = home / "snapshots"
    (kept,) = [p.name for p in snapshots.iterdir() if p.is_file()]
    stale = snapshots / "deadbeef-1.kvs"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = snapshots / "deadbeef-2.kvs"  # may be another process's, between rename and commit
    fresh.write_bytes(b"x")
    torn = snapshots / "cafebabe-3.kvs.999999999.tmp"  # no such pid: its writer is dead
    torn.write_bytes(b"x")
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    service = ChatService(Settings())
    service.close()
    assert sorted(p.name for p in snapshots.iterdir() if p.is_file()) == sorted([kept, fresh.name])


def test_private_permissions(one_turn_home):
    home = one_turn_home[0]
    assert (home.stat().st_mode & 0o777) == 0o700
    assert ((home / "snapshots").stat().st_mode & 0o777) == 0o700
    assert ((home / "kvchat.db").stat().st_mode & 0o777) == 0o600
    files = [p for p in (home / "snapshots").rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert (path.stat().st_mode & 0o777) == 0o600
    for path in (home / "snapshots").rglob("*"):
        if path.is_dir():
            assert (path.stat().st_mode & 0o777) == 0o700
