"""Resume in a new process from a disk snapshot: counts, equality with a full prefill."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import FAST


def test_second_process_restores_from_disk_and_decodes_only_the_new_turn(
    one_turn_home, copy_home, cli
):
    home = copy_home(one_turn_home[0], "a")
    first = one_turn_home[1]
    assert first["restore"]["from"] == "none"
    assert first["tokens"]["reused"] == 0
    assert first["tokens"]["decoded"] == first["tokens"]["prompt"]
    snapshot_tokens = (
        sqlite3.connect(home / "kvchat.db")
        .execute("SELECT n_tokens FROM kv_snapshots WHERE session_id=?", (first["session"],))
        .fetchone()[0]
    )
    assert snapshot_tokens > first["tokens"]["prompt"]  # prompt + reply + next turn's opening

    second = cli(home, "ask", "--session", first["session"], "And then?", "--json", *FAST).json

    assert second["restore"]["from"] == "disk"
    assert second["restore"]["reason"] is None
    assert second["restore"]["tokens"] == snapshot_tokens
    assert second["tokens"]["reused"] == snapshot_tokens
    assert second["tokens"]["decoded"] == second["tokens"]["prompt"] - snapshot_tokens
    assert 0 < second["tokens"]["decoded"] < 64
    assert second["restore"]["bytes"] > 0


def test_session_by_title_prefix_and_a_third_turn_keeps_reusing(one_turn_home, copy_home, cli):
    home = copy_home(one_turn_home[0], "a")
    second = cli(home, "ask", "--session", "Hi", "And then?", "--json", *FAST).json
    third = cli(home, "ask", "--session", second["session"], "Why?", "--json", *FAST).json
    assert third["restore"]["from"] == "disk"
    assert third["tokens"]["reused"] == third["restore"]["tokens"]
    assert third["tokens"]["reused"] > second["tokens"]["prompt"]
    assert third["tokens"]["decoded"] < 64


def test_plain_ask_streams_the_reply_and_reports_on_stderr(kvhome: Path, cli):
    result = cli(kvhome, "ask", "Hi", *FAST)
    assert result.stdout.strip()
    assert "full prefill: no snapshot saved for this session yet" in result.stderr
    listed = cli(kvhome, "list", "--json").json
    assert len(listed) == 1
    assert listed[0]["messages"] == 2
    assert listed[0]["snapshot_bytes"] > 0
    assert result.stdout.strip() in cli(kvhome, "export", listed[0]["id"]).stdout


# --- KV per setting (issue 11 item 3) ---------------------------------------------------------

NORMAL = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "1024", "--threads", "1"]
SMALL = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "512", "--threads", "1"]
_NOTE_WORDS = (
    "river mountain library garden engine signal theory market history music science planet "
    "ocean village lantern harbour meadow orchard bridge valley forest desert island canyon"
).split()


def note(i: int, words: int = 85) -> str:
    """A long user message (~125 tokens) that differs per turn: history grows fast and cheap."""
    body = " ".join(_NOTE_WORDS[(i * 7 + k * 3) % len(_NOTE_WORDS)] for k in range(words))
    return f"Note {i}: {body}. Reply with one short sentence."


def snapshot_tokens(home: Path, session_id: str) -> int:
    with sqlite3.connect(home / "kvchat.db") as db:
        row = db.execute(
            "SELECT n_tokens FROM kv_snapshots WHERE session_id=?", (session_id,)
        ).fetchone()
    return int(row[0])


@pytest.fixture(scope="module")
def five_notes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A home holding one session of five long notes and their greedy replies at n_ctx 1024
    (more than n_ctx 512 holds), its snapshot saved; built once, copied by each test."""
    from kvchat.config import load_settings
    from kvchat.service.chat import open_service

    home = tmp_path_factory.mktemp("five-notes") / "home"
    settings = load_settings(n_ctx=1024, temperature=0.0, max_tokens=16, n_threads=1)
    with open_service(settings, home=home) as svc:
        session_id = svc.start(note(0)).session_id
        for i in range(1, 5):
            svc.send(session_id, note(i))
    return home, session_id


def _copy_of(five_notes: tuple[Path, str], kvhome: Path) -> str:
    shutil.copytree(five_notes[0], kvhome)
    return five_notes[1]


def test_one_run_with_a_smaller_context_keeps_the_long_snapshot_for_the_next_normal_turn(
    kvhome: Path, cli, five_notes: tuple[Path, str]
) -> None:
    session_id = _copy_of(five_notes, kvhome)
    long_tokens = snapshot_tokens(kvhome, session_id)
    assert long_tokens > 512  # more than n_ctx 512 holds

    small = cli(kvhome, "ask", "--session", session_id, "Which note was first?", "--json", *SMALL)
    small = small.json
    assert small["window"]["dropped_messages"] > 0
    assert small["restore"]["from"] == "none"  # the long snapshot does not fit n_ctx 512
    assert snapshot_tokens(kvhome, session_id) < 512  # this setting's own snapshot

    normal = cli(kvhome, "ask", "--session", session_id, "And the last?", "--json", *NORMAL)
    normal = normal.json
    # The long snapshot was kept for this setting: restored, and the history not re-read.
    assert normal["restore"]["from"] == "disk"
    assert normal["restore"]["tokens"] == long_tokens
    assert normal["tokens"]["reused"] == long_tokens
    # Decoded: the small run's question and reply, and this message; never the history.
    assert normal["tokens"]["decoded"] == normal["tokens"]["prompt"] - long_tokens < 128

    # And the small setting's own snapshot was kept for it in turn.
    again = cli(kvhome, "ask", "--session", session_id, "Which note?", "--json", *SMALL).json
    assert again["restore"]["from"] == "disk"
    assert again["restore"]["tokens"] == again["tokens"]["reused"] < 512
    assert again["tokens"]["decoded"] < 128


def test_a_turn_line_never_claims_a_restore_the_prompt_does_not_use(
    kvhome: Path, cli, five_notes: tuple[Path, str]
) -> None:
    session_id = _copy_of(five_notes, kvhome)
    small = cli(kvhome, "ask", "--session", session_id, "First?", "--json", *SMALL).json
    assert small["window"]["dropped_messages"] > 0
    with sqlite3.connect(kvhome / "kvchat.db") as db:
        db.execute("DELETE FROM kv_snapshot_shelf")  # (as if evicted for the disk budget)

    result = cli(kvhome, "ask", "--session", session_id, "Last?", *NORMAL)

    # Only the small run's window is saved: it shares just the system prompt with this one.
    line = next(line for line in result.stderr.splitlines() if "decoded" in line)
    assert "restored" not in line
    assert "full prefill: its saved KV" in line and "shares only" in line
