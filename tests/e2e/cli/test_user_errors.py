"""User errors: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest


def assert_user_error(result, text: str) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvchat: ") and text in lines[0]


def test_unknown_session(kvhome: Path, cli):
    assert_user_error(
        cli(kvhome, "ask", "--session", "nope", "Hi", check=False), "no session matches"
    )
    assert_user_error(cli(kvhome, "export", "nope", check=False), "no session matches")


def test_missing_model(kvhome: Path, cli, tmp_path: Path):
    missing = tmp_path / "missing.gguf"
    result = cli(kvhome, "ask", "Hi", "--model", str(missing), check=False)
    assert_user_error(result, f"model file not found: {missing}")


@pytest.mark.parametrize("content", [b"", b"not a model at all", b"GGU"])
def test_not_a_gguf(kvhome: Path, cli, tmp_path: Path, content: bytes):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(content)
    assert_user_error(cli(kvhome, "ask", "Hi", "--model", str(bogus), check=False), "not a GGUF")


def test_no_message_is_stored_when_the_model_is_unusable(kvhome: Path, cli, tmp_path: Path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"nope")
    cli(kvhome, "ask", "Hi", "--model", str(bogus), check=False)
    assert cli(kvhome, "list", "--json").json == []


def test_session_and_new_together(kvhome: Path, cli):
    assert_user_error(cli(kvhome, "ask", "--new", "--session", "x", "Hi", check=False), "either")


def test_list_empty(kvhome: Path, cli):
    assert "No sessions yet" in cli(kvhome, "list").stdout


# --- issue 22.17: `kvchat list` nits ---------------------------------------------------------


def test_list_reads_only_it_makes_no_database(kvhome: Path, cli):
    result = cli(kvhome, "list")
    assert "No sessions yet" in result.stdout and result.stderr == ""
    assert cli(kvhome, "list", "--json").json == []
    exported = cli(kvhome, "export", "anything", check=False)
    assert_user_error(exported, "no session matches")
    assert not (kvhome / "kvchat.db").exists()


def test_list_into_head_ends_quietly(kvhome: Path, tmp_path: Path):
    import subprocess
    import sys

    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from tests.conftest import REPO, clean_env

    service = ChatService(Settings())
    for n in range(1500):  # more than a pipe holds: the writer meets the closed pipe
        service.sessions.new_session(f"Session number {n}")
    service.close()
    env = {**clean_env(), "KVCHAT_HOME": str(kvhome)}
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m kvchat list | head -1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.startswith("ID ") and proc.stdout.count("\n") == 1
    assert proc.stderr == "" and proc.returncode == 0


def test_list_columns_line_up_with_wide_titles(kvhome: Path, cli):
    from rich.cells import cell_len

    from kvchat.config import Settings
    from kvchat.service.chat import ChatService

    service = ChatService(Settings())
    for title in (
        "日本への旅行の計画",
        "Plan a trip to Japan",
        "東京と京都と大阪と奈良と広島の旅行の計画を立てる",
    ):
        session = service.sessions.new_session(title)
        service.sessions.add_message(session.id, "user", "hello")
    service.close()
    lines = cli(kvhome, "list").stdout.splitlines()
    assert len(lines) == 4
    assert len({cell_len(line) for line in lines}) == 1, lines  # every column lines up
    msgs_at = {cell_len(line[: line.index(" 1 ")]) for line in lines[1:]}
    assert len(msgs_at) == 1, lines
    assert any("…" in line for line in lines)  # the long title is cut to its column


def test_ask_says_how_far_a_long_prompt_is_read(kvhome: Path):
    import subprocess
    import sys

    from tests.conftest import REPO, clean_env
    from tests.e2e.tui.test_tui_nothing_typed_is_lost import LONG_MESSAGE

    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "--n-ctx", "4096", "--max-tokens", "2", "-"],
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(kvhome), "KVCHAT_N_THREADS": "1"},
        input=LONG_MESSAGE,  # ~520 tokens: a read of ~5 s on one thread here
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "reading the prompt ·" in line]
    assert lines, proc.stderr  # a line after 2 s (stderr is not a terminal here)
    assert " tokens" in lines[0] and " left" in lines[0]
