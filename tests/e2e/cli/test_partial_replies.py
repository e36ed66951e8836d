"""A reply is kept as it streams: a reply cut mid-character stores no replacement
character, `ask --continue` appends to the last reply, a killed `kvchat ask` leaves its
partial reply, and the final commit replaces the streamed partial. Real `kvchat`
processes on the real model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import FAST, REPO, run_cli_here
from tests.e2e.cli.test_input_validation import _env

# --- item 4: cut replies: never a broken character; "stopped at the token limit"; continue -----

EMOJI_PROMPT = "Reply with five flower emoji and nothing else."


def test_a_reply_cut_mid_character_stores_no_replacement_character(kvhome: Path) -> None:
    from kvchat.config import load_settings
    from kvchat.service.chat import ChatService

    service = ChatService(load_settings(n_ctx=1024))
    try:
        replies: dict[int, str] = {}
        sessions: dict[int, str] = {}
        for n in range(26, 32):  # the bundled model's emoji take several tokens each
            report = service.start(EMOJI_PROMPT, temperature=0, max_tokens=n)
            stored = service.sessions.messages(report.session_id)[-1].content
            assert "\ufffd" not in report.reply and "\ufffd" not in stored, (n, stored)
            assert "\ufffd" not in service.sessions.export(report.session_id, "md")
            assert report.finish_reason == "length"
            assert "stopped at the token limit" in report.summary()
            replies[n] = report.reply
            sessions[n] = report.session_id
        # Some limits did cut inside a character (a token that ended nothing added no text).
        assert any(replies[n] == replies[n - 1] for n in range(27, 32))
        cut = next(n for n in range(27, 32) if replies[n] == replies[n - 1])
        session = service.store.get_session(sessions[cut])
        before = service.sessions.messages(session.id)[-1]
        assert before.content == replies[cut]
        # Continue: more text appended to the same stored reply, from the hot KV.
        report = service.continue_reply(session.id, temperature=0, max_tokens=8)
        after = service.sessions.messages(session.id)
        assert [m.id for m in after][-1] == before.id and len(after) == 2
        assert after[-1].content == before.content + report.reply
        assert report.reply and "\ufffd" not in after[-1].content
        assert after[-1].content.count("\U0001f333") > before.content.count("\U0001f333")
    finally:
        service.close()


def test_ask_continue_appends_to_the_last_reply(one_turn_home, copy_home) -> None:
    source, turn = one_turn_home
    home = copy_home(source, "continue-home")
    session = turn["session"]
    before = run_cli_here(home, "export", session, "--format", "json").json["messages"]
    result = run_cli_here(home, "ask", "--continue", "--session", session, "--json", *FAST)
    more = result.json["reply"]
    after = run_cli_here(home, "export", session, "--format", "json").json["messages"]
    assert len(after) == len(before)
    assert after[-1]["content"] == before[-1]["content"] + more
    bad = run_cli_here(home, "ask", "--continue", "Hi", check=False)
    assert bad.returncode == 2 and "--session" in bad.stderr


# --- item 5: a partial reply is kept as it streams ---------------------------------------------


def _partial_reply_stored(home: Path) -> bool:
    """Whether the database holds more than 20 characters of a reply still being written."""
    import sqlite3

    if not (home / "kvchat.db").exists():
        return False
    db = sqlite3.connect(home / "kvchat.db")
    try:
        row = db.execute(
            "SELECT max(length(content)) FROM messages WHERE role = 'assistant' AND partial = 1"
        ).fetchone()
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()
    return bool(row and row[0] and row[0] > 20)


def test_a_killed_ask_leaves_its_partial_reply(kvhome: Path) -> None:
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "ask", "--new"]
        + ["Write the numbers from 1 to 500 separated by commas."]
        + ["--temperature", "0", "--max-tokens", "1500", "--n-ctx", "4096"],
        cwd=REPO,
        env=_env(kvhome),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.read(1)  # the reply has begun streaming
        assert first, "no reply streamed"
        # Killed as soon as the database holds part of the reply (an event, not a time: a
        # fast machine would finish a reply that a sleep waited for).
        deadline = time.monotonic() + 120
        while not _partial_reply_stored(kvhome):
            assert proc.poll() is None, "the reply ended before its first save"
            assert time.monotonic() < deadline, "no partial reply was stored"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        streamed = first + proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    sessions = run_cli_here(kvhome, "list", "--json").json
    assert len(sessions) == 1
    session = sessions[0]["id"]
    messages = run_cli_here(kvhome, "export", session, "--format", "json").json["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    reply = messages[1]
    assert reply.get("partial") is True
    assert len(reply["content"]) > 20 and "," in reply["content"]
    # The pipe and the database each hold a prefix of the same reply (either may be ahead).
    shown, kept = streamed.decode("utf-8", "ignore"), reply["content"]
    assert shown.startswith(kept) or kept.startswith(shown)


def test_the_final_commit_replaces_the_streamed_partial(kvhome: Path, monkeypatch) -> None:
    from kvchat.config import load_settings
    from kvchat.service import chat as chat_module
    from kvchat.service.chat import ChatService

    monkeypatch.setattr(chat_module, "STREAM_SAVE_EVERY_S", 0.0)  # save after every piece
    service = ChatService(load_settings(n_ctx=1024))
    saved: list[tuple[str, bool]] = []
    try:
        store = service.store
        original = store.update_message

        def spy(message_id, content, partial, **kw):
            saved.append((content, partial))
            return original(message_id, content, partial, **kw)

        monkeypatch.setattr(store, "update_message", spy)
        report = service.start("Count from 1 to 20.", temperature=0, max_tokens=24)
        messages = service.sessions.messages(report.session_id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[-1].id == report.message_id
        assert messages[-1].content == report.reply and not messages[-1].partial
        assert any(partial for _, partial in saved)  # it was partial while streaming
        assert saved[-1] == (report.reply, False)
    finally:
        service.close()
