"""``kvchat compact SESSION`` in its own process (issue 42): the cost first, --dry-run
changes nothing, --summary with --yes compacts (JSON figures), no --yes off a terminal is
one line and nothing changes, a refused summary is one line, and kill -9 while the model
writes the summary leaves the conversation as it was, and at any moment of accepting one,
the conversation is as it was or compacted with its branch, never half."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import zipfile
from contextlib import closing
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from tests.conftest import REPO, CliResult, clean_env, run_cli

FLAGS = ["--n-ctx", "512", "--threads", "1"]
# The reply reserve a plan keeps (max_tokens) comes from the settings: the environment here.
ENV = {"KVCHAT_MAX_TOKENS": "16"}


def kvchat(home: Path, *args: str, check: bool = True) -> CliResult:
    return run_cli(home, *args, env=ENV, check=check)


def filled_home(home: Path, exchanges: int = 16) -> str:
    """A session longer than a 512-token context, stored as text."""
    service = ChatService(load_settings(n_ctx=512, max_tokens=16), home=home)
    try:
        session = service.sessions.new_session(title="Long talk")
        for i in range(exchanges):
            service.sessions.add_message(
                session.id, "user", f"Turn {i}: tell me one fact about rivers, please."
            )
            service.sessions.add_message(
                session.id, "assistant", f"Fact {i}: rivers carve valleys over many years."
            )
        return session.id
    finally:
        service.close()


def counts(home: Path) -> tuple[int, int, int]:
    """Sessions, messages and summaries in the home's database."""
    with closing(sqlite3.connect(home / "kvchat.db")) as db:
        return tuple(
            db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("sessions", "messages", "summaries")
        )


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Path, str]:
    home = tmp_path / "home"
    return home, filled_home(home)


def test_dry_run_says_the_cost_and_changes_nothing(filled: tuple[Path, str]) -> None:
    home, session_id = filled
    before = counts(home)
    result = kvchat(home, "compact", session_id, "--dry-run", "--json", *FLAGS)
    plan = result.json["plan"]
    assert plan["covered"] > 0 and plan["replaced_tokens"] > plan["kept_tokens"] > 0
    assert counts(home) == before
    line = kvchat(home, "compact", "Long", "--dry-run", *FLAGS).stderr
    assert line.startswith(f"a summary replaces {plan['replaced_tokens']:,} tokens")


def test_ask_warns_before_the_next_turn_leaves_messages_out(filled: tuple[Path, str]) -> None:
    home, session_id = filled
    result = kvchat(home, "ask", "--session", session_id, "And lakes?", *FLAGS)
    assert "old messages left the window" in result.stderr
    assert (
        "kvchat: the context is nearly full: the next turn leaves the oldest messages out "
        f"unless you compact them (kvchat compact {session_id} writes a summary"
    ) in result.stderr


def test_a_given_summary_is_kept_with_yes(filled: tuple[Path, str]) -> None:
    home, session_id = filled
    sessions, messages, _ = counts(home)
    result = kvchat(
        home,
        "compact",
        session_id,
        "--summary",
        "They talked about rivers.",
        "--yes",
        "--json",
        *FLAGS,
    )
    done = result.json
    assert done["summary"]["text"] == "They talked about rivers."
    assert done["decoded"] > 0 and done["snapshot_bytes"] > 0 and done["snapshot_error"] is None
    # One more session (the branch before), every message twice (the branch copies them).
    assert counts(home) == (sessions + 1, 2 * messages, 1)
    ask = kvchat(home, "ask", "--session", session_id, "And lakes?", "--json", *FLAGS).json
    assert ask["restore"]["from"] == "disk"
    assert ask["window"]["summarized"] == done["plan"]["covered"]
    assert ask["tokens"]["decoded"] <= 20  # its message and the template's few tokens


def test_a_bundle_of_a_compacted_session_carries_the_summary_and_resumes(
    filled: tuple[Path, str], tmp_path: Path
) -> None:
    home, session_id = filled
    kvchat(home, "compact", session_id, "--summary", "They talked about rivers.", "--yes", *FLAGS)
    bundle = tmp_path / "long.zip"
    kvchat(home, "export", session_id, "--format", "bundle", "-o", str(bundle))
    with zipfile.ZipFile(bundle) as archive:
        exported = json.loads(archive.read("messages.json"))
    (summary,) = exported["summaries"]
    assert summary["text"] == "They talked about rivers."
    assert exported["messages"][summary["after"]]["content"].startswith("Fact ")
    assert len(exported["messages"]) == 32  # every message, the summarized ones too
    other = tmp_path / "other"
    (entry,) = kvchat(other, "import", str(bundle), "--json").json["sessions"]
    assert entry["kv"]["reason"] is None and entry["kv"]["tokens"] > 0
    imported = entry["session"]
    # The import places the summary where it applies: the bundle resumes from its KV.
    ask = kvchat(other, "ask", "--session", imported, "And lakes?", "--json", *FLAGS).json
    assert ask["restore"]["from"] == "disk"
    assert ask["tokens"]["reused"] >= entry["kv"]["tokens"] - 4
    assert ask["tokens"]["decoded"] <= 20  # its message and the template's few tokens
    assert ask["window"]["summarized"] == summary["after"] + 1
    again = kvchat(other, "export", imported, "--format", "json").json
    assert again["summaries"][0]["text"] == summary["text"]
    assert again["summaries"][0]["after"] == summary["after"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "not compacted: keep the summary with --yes"),
        (["--summary", "   ", "--yes"], "the summary is empty: nothing was compacted"),
        (["--summary", "rivers " * 400, "--yes"], "is not shorter than the"),
        (["--summary", "bad \udcff bytes", "--yes"], "the summary"),
    ],
    ids=["no-yes-off-a-terminal", "empty", "too-long", "not-text"],
)
def test_a_summary_not_kept_is_one_line_and_changes_nothing(
    filled: tuple[Path, str], extra: list[str], says: str
) -> None:
    home, session_id = filled
    before = counts(home)
    args = ["compact", session_id, *extra, *FLAGS]
    if not extra:
        args[2:2] = ["--summary", "They talked about rivers."]
    result = kvchat(home, *args, check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kvchat: ") and says in last
    assert "Traceback" not in result.stderr
    assert counts(home) == before


def test_kill_while_the_summary_is_written_leaves_the_conversation_as_it_was(
    filled: tuple[Path, str],
) -> None:
    home, session_id = filled
    before = counts(home)
    env = clean_env() | ENV | {"KVCHAT_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "compact", session_id, "--yes", *FLAGS],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), True)
        first = proc.stdout.read(1)  # the summary's first byte: the model is writing it
        assert first, proc.stderr.read().decode() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.1)
    assert counts(home) == before  # no summary, no branch
    ask = kvchat(home, "ask", "--session", session_id, "And lakes?", "--json", *FLAGS).json
    assert ask["window"]["summarized"] == 0 and ask["reply"]


def _titles(home: Path) -> list[str]:
    with closing(sqlite3.connect(home / "kvchat.db")) as db:
        return sorted(title for (title,) in db.execute("SELECT title FROM sessions"))


@pytest.mark.parametrize(
    "fractions",
    [
        pytest.param((0.35, 0.5), id="sample"),
        pytest.param(tuple(i / 10 for i in range(1, 10)), id="tenths", marks=pytest.mark.stress),
    ],
)
def test_a_kill_while_a_summary_is_accepted_leaves_it_whole_or_as_it_was(
    tmp_path: Path, fractions: tuple[float, ...]
) -> None:
    """kill -9 at points spread over one whole `kvchat compact --summary --yes` on this machine
    (its start, the model's load, the compacted prompt's read, the summary row, the KV):
    the home holds the conversation as it was, or compacted with its "Before compaction"
    branch; never the branch without the summary."""
    source = tmp_path / "source"
    session_id = filled_home(source)
    before, titles_before = counts(source), _titles(source)
    argv = ["compact", session_id, "--summary", "They talked about rivers.", "--yes", *FLAGS]
    whole = tmp_path / "whole"
    shutil.copytree(source, whole)
    started = time.monotonic()
    kvchat(whole, *argv)
    whole_s = time.monotonic() - started
    after, titles_after = counts(whole), _titles(whole)
    assert after[0] == before[0] + 1 and after[2] == before[2] + 1
    seen = []
    for i, fraction in enumerate(fractions):
        home = tmp_path / f"killed-{i}"
        shutil.copytree(source, home)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvchat", *argv],
            cwd=REPO,
            env=clean_env() | ENV | {"KVCHAT_HOME": str(home)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(fraction * whole_s)
        proc.kill()
        proc.wait(timeout=60)
        state = (counts(home), _titles(home))
        assert state in ((before, titles_before), (after, titles_after)), (fraction, state)
        seen.append(state == (after, titles_after))
    # The conversation goes on from whatever the last kill left.
    ask = kvchat(home, "ask", "--session", session_id, "And lakes?", "--json", *FLAGS).json
    assert ask["reply"] and (ask["window"]["summarized"] > 0) == seen[-1]
