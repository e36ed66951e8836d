"""Fork, export-bundle and gc take the session's turn lock like a turn:
none of them copies or evicts what a streaming reply is still writing."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST, REPO, clean_env, run_cli_here

LONG = ["--temperature", "0", "--max-tokens", "600", "--n-ctx", "2048"]


def _partial_rows(home: Path, session: str) -> int:
    db = sqlite3.connect(f"file:{home / 'kvchat.db'}?mode=ro", uri=True)
    try:
        return db.execute(
            "SELECT count(*) FROM messages WHERE session_id=? AND partial=1", (session,)
        ).fetchone()[0]
    finally:
        db.close()


def _start(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = clean_env()
    full.update(KVCHAT_HOME=str(home), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "kvchat", *args],
        cwd=REPO,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _streaming(home: Path, session: str) -> subprocess.Popen[str]:
    """A turn streaming a long reply on ``session``, once its partial reply is stored."""
    # Greedy, this reply runs to the 600-token limit (8 s on one quiet thread here, twice the
    # commands' start and their 3 s of waiting for the lock; a busy machine slows both): it is
    # caught streaming every time.
    story = "Write a long essay about the history of Rome."
    turn = _start(home, "ask", "--session", session, "--json", *LONG, story)
    deadline = time.monotonic() + 120
    while _partial_rows(home, session) == 0:
        if turn.poll() is not None or time.monotonic() > deadline:
            turn.kill()
            out, err = turn.communicate()
            pytest.fail(f"the reply was not caught streaming (rc {turn.returncode}): {err}")
        time.sleep(0.1)
    return turn


def test_fork_export_and_gc_wait_for_a_streaming_reply(tmp_path):
    home = tmp_path / "home"
    first = run_cli_here(home, "ask", "--new", "Hi", "--json", *FAST).json
    session = first["session"]
    idle = run_cli_here(home, "ask", "--new", "Hello there", "--json", *FAST).json["session"]
    bundle = tmp_path / "b.kvchat"
    turn = _streaming(home, session)
    try:
        # All at once, while the reply streams (each waits a few seconds for the lock).
        commands = [
            _start(home, "fork", session, "--json"),
            _start(home, "export", session, "--format", "bundle", "-o", str(bundle)),
            _start(home, "cache", "gc", env={"KVCHAT_DISK_CACHE_GIB": "0.000001"}),
        ]
        results = [(c.wait(120), *c.communicate()) for c in commands]
        still_streaming = turn.poll() is None
    finally:
        out, err = turn.communicate(timeout=300)
    assert turn.returncode == 0, err
    assert still_streaming, "the reply ended while the commands ran"
    (fork_rc, _, fork_err), (export_rc, _, export_err), (gc_rc, gc_out, gc_err) = results
    for rc, stderr in ((fork_rc, fork_err), (export_rc, export_err)):
        assert rc == 2 and "busy" in stderr and len(stderr.strip().splitlines()) == 1
    assert not bundle.exists()
    assert gc_rc == 0 and "evicted 1 snapshots" in gc_out, gc_err  # the idle session's

    db = sqlite3.connect(home / "kvchat.db")
    titles = [t for (t,) in db.execute("SELECT title FROM sessions")]
    assert not any(t.startswith("Fork at") for t in titles)  # no fork was made
    kept = {s for (s,) in db.execute("SELECT session_id FROM kv_snapshots")}
    assert session in kept and idle not in kept

    # Once the turn has ended, the fork holds the whole reply, not a cut one.
    child = run_cli_here(home, "fork", session, "--json").json
    rows = db.execute(
        "SELECT content, partial FROM messages WHERE session_id=? ORDER BY id", (child["session"],)
    ).fetchall()
    parent = db.execute(
        "SELECT content, partial FROM messages WHERE session_id=? ORDER BY id", (session,)
    ).fetchall()
    assert rows == parent and rows[-1][1] == 0


def _hold(directory: str, session_id: str, ready: Any, release: Any) -> None:
    from kvchat.store.locks import SessionLocks

    with SessionLocks(Path(directory)).hold(session_id):
        ready.set()
        release.wait(60)


def test_edit_and_fork_wait_for_the_turn_lock_then_say_busy(kvhome: Path):
    import multiprocessing

    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from kvchat.store.locks import SessionBusy

    service = ChatService(Settings(temperature=0.0, max_tokens=8, n_ctx=1024))
    try:
        session = service.sessions.new_session()
        first = service.sessions.add_message(session.id, "user", "Hi")
        service.sessions.add_message(session.id, "assistant", "Hello", partial=True)  # streaming
        ctx = multiprocessing.get_context("spawn")
        ready, release = ctx.Event(), ctx.Event()
        holder = ctx.Process(target=_hold, args=(str(kvhome / "locks"), session.id, ready, release))
        holder.start()
        try:
            assert ready.wait(60)
            before = len(service.sessions.list_sessions())
            for act in (
                lambda: service.sessions.edit(session.id, first.id, "Hi there"),
                lambda: service.sessions.fork(session.id),
            ):
                with pytest.raises(SessionBusy, match="busy"):
                    act()
            assert len(service.sessions.list_sessions()) == before  # no branch of a streaming reply
        finally:
            release.set()
            holder.join(60)
        assert service.sessions.fork(session.id).id  # free again: the fork is made
    finally:
        service.close()
