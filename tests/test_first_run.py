"""Issue 11's service and CLI items: what a first run tripped over (kvchat ask, fork, relaunch,
cut replies, partial replies kept as they stream)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, clean_env, run_cli

# End-to-end: the first run is tried through `kvchat` processes.
pytestmark = pytest.mark.e2e


def _env(home: Path) -> dict[str, str]:
    env = clean_env()
    env["KVCHAT_HOME"] = str(home)
    return env


# --- item 8: commands ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["ask", ""],
        ["ask", "   "],
        ["ask", "Hi", "--max-tokens", "0"],
        ["ask", "Hi", "--temperature", "-1"],
        ["ask", "Hi", "--temperature", "3"],
        ["ask", "Hi", "--top-p", "0"],
        ["ask", "Hi", "--top-p", "1.5"],
        ["ask", "Hi", "--seed", "-2"],
    ],
)
def test_ask_refuses_bad_input_before_storing_anything(kvhome: Path, args: list[str]) -> None:
    result = run_cli(kvhome, *args, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvchat: ")
    assert "Traceback" not in result.stderr
    assert run_cli(kvhome, "list", "--json").json == []


def test_ask_temperature_message_names_the_range(kvhome: Path) -> None:
    result = run_cli(kvhome, "ask", "Hi", "--temperature", "3", check=False)
    assert "temperature must be from 0 to 2" in result.stderr


def test_service_refuses_out_of_range_overrides(kvhome: Path) -> None:
    from kvchat.config import load_settings
    from kvchat.errors import KvchatError
    from kvchat.service.reports import generation_params

    settings = load_settings()
    with pytest.raises(KvchatError, match="temperature"):
        generation_params(settings, {}, {"temperature": 120})
    with pytest.raises(KvchatError, match="max_tokens"):
        generation_params(settings, {}, {"max_tokens": 0})
    assert generation_params(settings, {}, {"temperature": 2.0}).temperature == 2.0


def test_help_says_no_command_opens_the_app(kvhome: Path) -> None:
    text = " ".join(run_cli(kvhome, "--help").stdout.split())
    assert "none of them opens the app" in text
    assert "with no command to open the terminal app" in text


@pytest.mark.parametrize("command", ["fork", "cache"])
def test_json_flags_have_help(kvhome: Path, command: str) -> None:
    out = run_cli(kvhome, command, "--help").stdout
    line = next(line for line in out.splitlines() if "--json" in line)
    assert "JSON" in line.split("--json", 1)[1]


def test_models_pull_names_the_extra(kvhome: Path) -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'pull = ["huggingface-hub>=0.24"]' in pyproject
    readme = (REPO / "README.md").read_text()
    shell = readme.split("### From the shell", 1)[1].split("```", 2)[1]
    assert "kvchat[pull]" in shell
    # Without huggingface_hub importable, `models pull` says which extra to install.
    blocker = kvhome.parent / "nohub"
    (blocker / "huggingface_hub").mkdir(parents=True)
    (blocker / "huggingface_hub" / "__init__.py").write_text("raise ImportError('absent')\n")
    env = {"PYTHONPATH": str(blocker)}
    result = run_cli(
        kvhome, "models", "pull", "--repo", "a/b", "--file", "x.gguf", env=env, check=False
    )
    assert result.returncode == 2
    assert "pip install 'kvchat[pull]'" in result.stderr


def test_ask_dash_reads_the_message_from_stdin(kvhome: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "-", "--json", *FAST],
        cwd=REPO,
        env=_env(kvhome),
        input="What is 2+2? [piped]\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    session = __import__("json").loads(proc.stdout)["session"]
    md = run_cli(kvhome, "export", session, "--format", "json").json
    assert md["messages"][0]["content"] == "What is 2+2? [piped]"


# --- item 6: fork --at N (the message's number) and numbered fork titles ----------------------


def test_fork_at_takes_the_message_number_and_numbers_titles(one_turn_home, copy_home) -> None:
    source, turn = one_turn_home
    home = copy_home(source, "fork-home")
    session = turn["session"]
    first = run_cli(home, "fork", session, "--at", "1", "--json").json
    assert first["messages"] == 1
    exported = run_cli(home, "export", first["session"], "--format", "json").json
    assert [m["role"] for m in exported["messages"]] == ["user"]
    parent_title = run_cli(home, "export", session, "--format", "json").json["session"]["title"]
    # Named by what it is and where it starts, first (issue 22.8).
    assert first["title"] == f"Fork at #1: {parent_title}"
    second = run_cli(home, "fork", session, "--json").json
    assert second["title"] == f"Fork at #2: {parent_title}" and second["messages"] == 2
    again = run_cli(home, "fork", session, "--json").json
    assert again["title"] == f"Fork at #2 (2): {parent_title}"
    # A fork of a fork names the original title once.
    third = run_cli(home, "fork", first["session"], "--json").json
    assert third["title"] == f"Fork at #1 (2): {parent_title}"
    # Numbers out of range are one line, exit 2; nothing is made.
    for bad in ("0", "3"):
        result = run_cli(home, "fork", session, "--at", bad, check=False)
        assert result.returncode == 2 and "no message #" in result.stderr, result.stderr
    assert len(run_cli(home, "list", "--json").json) == 5
    assert "--at N" in run_cli(home, "fork", "--help").stdout


# --- item 2: relaunch opens the session the app had open ---------------------------------------


def test_relaunch_opens_the_session_the_app_had_open(kvhome: Path) -> None:
    from kvchat.config import load_settings
    from kvchat.service.chat import ChatService

    service = ChatService(load_settings())
    try:
        assert service.reader.last_open_session() is None
        a = service.sessions.new_session("A")
        b = service.sessions.new_session("B")
        assert service.reader.last_open_session().id == b.id  # never opened: the last one made
        service.sessions.remember_open(a.id)
        service.sessions.new_session("made by a CLI ask")
        service.sessions.fork(b.id)
        assert service.reader.last_open_session().id == a.id
    finally:
        service.close()
    # A new process (a relaunch) reads the same.
    service = ChatService(load_settings())
    try:
        assert service.reader.last_open_session().id == a.id
        service.sessions.delete(a.id)
        assert service.reader.last_open_session() is not None  # gone: the fallback, no error
    finally:
        service.close()


# --- item 4: cut replies: never a broken character; "stopped at the token limit"; continue -----

EMOJI_PROMPT = "Reply with five flower emoji and nothing else."


@pytest.mark.e2e
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
    before = run_cli(home, "export", session, "--format", "json").json["messages"]
    result = run_cli(home, "ask", "--continue", "--session", session, "--json", *FAST)
    more = result.json["reply"]
    after = run_cli(home, "export", session, "--format", "json").json["messages"]
    assert len(after) == len(before)
    assert after[-1]["content"] == before[-1]["content"] + more
    bad = run_cli(home, "ask", "--continue", "Hi", check=False)
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


@pytest.mark.e2e
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
    sessions = run_cli(kvhome, "list", "--json").json
    assert len(sessions) == 1
    session = sessions[0]["id"]
    messages = run_cli(kvhome, "export", session, "--format", "json").json["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    reply = messages[1]
    assert reply.get("partial") is True
    assert len(reply["content"]) > 20 and "," in reply["content"]
    # The pipe and the database each hold a prefix of the same reply (either may be ahead).
    shown, kept = streamed.decode("utf-8", "ignore"), reply["content"]
    assert shown.startswith(kept) or kept.startswith(shown)


@pytest.mark.e2e
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
