"""Resume in a new process from a disk snapshot: counts, equality with a full prefill."""

from __future__ import annotations

import sqlite3
from pathlib import Path

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


def test_greedy_reply_after_restore_equals_reply_after_full_prefill(one_turn_home, copy_home, cli):
    session = one_turn_home[1]["session"]
    restored_home = copy_home(one_turn_home[0], "restored")
    baseline_home = copy_home(one_turn_home[0], "baseline")
    message = "Tell me one fact about the Moon."

    restored = cli(restored_home, "ask", "--session", session, message, "--json", *FAST).json
    baseline = cli(
        baseline_home, "ask", "--session", session, message, "--no-restore", "--json", *FAST
    ).json

    assert restored["restore"]["from"] == "disk"
    assert baseline["restore"]["from"] == "none"
    assert baseline["tokens"]["reused"] == 0
    assert baseline["tokens"]["prompt"] == restored["tokens"]["prompt"]
    assert restored["reply"] == baseline["reply"]
    assert restored["tokens"]["generated"] == baseline["tokens"]["generated"] > 0


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
