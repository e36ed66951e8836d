"""The CLI refuses bad input before it stores anything: out-of-range flags, an empty or
unreadable message, with one line naming the range; help that says what no command does,
JSON flags with help (commands run in the test's process), and `ask -` reading the message
from stdin (a real `kvchat` process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, clean_env, run_cli, run_cli_here


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
    result = run_cli_here(kvhome, *args, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvchat: ")
    assert "Traceback" not in result.stderr
    assert run_cli_here(kvhome, "list", "--json").json == []


def test_ask_temperature_message_names_the_range(kvhome: Path) -> None:
    result = run_cli_here(kvhome, "ask", "Hi", "--temperature", "3", check=False)
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
    text = " ".join(run_cli_here(kvhome, "--help").stdout.split())
    assert "none of them opens the app" in text
    assert "with no command to open the terminal app" in text


@pytest.mark.parametrize("command", ["fork", "cache"])
def test_json_flags_have_help(kvhome: Path, command: str) -> None:
    out = run_cli_here(kvhome, command, "--help").stdout
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
    env = {"PYTHONPATH": str(blocker)}  # a new process's import path
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
    md = run_cli_here(kvhome, "export", session, "--format", "json").json
    assert md["messages"][0]["content"] == "What is 2+2? [piped]"
