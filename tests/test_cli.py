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
