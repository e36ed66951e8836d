"""The real `kvchat` CLI over a thousand imported conversations: import with
progress, a list that pages, and an export of every session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.bench.export_gen import write_chatgpt_export
from tests.conftest import REPO, CliResult, clean_env, run_cli_here

SESSIONS = 1000


@pytest.fixture(scope="module")
def big_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CliResult]:
    """A home of 1,000 imported conversations × 2 messages, and what the import printed."""
    root = tmp_path_factory.mktemp("thousand")
    export = root / "conversations.json"
    write_chatgpt_export(export, SESSIONS, 2)
    home = root / "home"
    return home, run_cli_here(home, "import", str(export))


def test_import_off_a_terminal_counts_on_stderr(big_home):
    _, result = big_home
    assert len(result.stdout.splitlines()) == SESSIONS  # one line per session, as before
    progress = [line for line in result.stderr.splitlines() if "conversations," in line]
    assert progress == [
        f"kvchat: {big_home[0].parent / 'conversations.json'}: 1,000 conversations,"
        " 2,000 messages read"
    ]


def test_list_into_a_pipe_prints_every_session(big_home):
    home, _ = big_home
    result = run_cli_here(home, "list")
    lines = result.stdout.splitlines()
    assert len(lines) == SESSIONS + 1 and lines[0].startswith("ID ")
    assert "Conversation 0:" in lines[1] and "Conversation 999:" in lines[-1]
    assert result.stderr == ""
    assert run_cli_here(home, "list", "--all").stdout == result.stdout


def test_list_loads_no_engine(big_home):
    """`kvchat list` reads titles: llama.cpp's bindings (a third of its time), numpy and
    sqlite-utils (only the migrations use it: ~0.2 s to import) stay unloaded."""
    home, _ = big_home
    env = {**clean_env(), "KVCHAT_HOME": str(home)}
    code = (
        "import sys\nfrom kvchat.cli import main\n"
        "try:\n    main(['list', '--limit', '3'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('llama_cpp', 'kvchat.kvcache', 'numpy', 'sqlite_utils')"
        " if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 5 and "Conversation 2:" in lines[3] and lines[-1] == "[]", lines


def test_list_limit_says_how_many_more(big_home):
    home, _ = big_home
    result = run_cli_here(home, "list", "--limit", "5")
    lines = result.stdout.splitlines()
    assert len(lines) == 6
    assert [line.split()[2] for line in lines[1:]] == ["0:", "1:", "2:", "3:", "4:"]
    assert result.stderr.strip() == "… 995 more sessions (kvchat list --all, or --limit N)"
    listed = run_cli_here(home, "list", "--json", "--limit", "3").json
    assert [item["title"].split(":")[0] for item in listed] == [
        "Conversation 0",
        "Conversation 1",
        "Conversation 2",
    ]
    assert len(run_cli_here(home, "list", "--json").json) == SESSIONS
    both = run_cli_here(home, "list", "--limit", "2", "--all", check=False)
    assert both.returncode == 2 and "either --limit or --all" in both.stderr


def test_list_on_a_terminal_shows_one_screen(big_home):
    home, _ = big_home
    master, slave = os.openpty()
    env = {**clean_env(), "KVCHAT_HOME": str(home), "LINES": "12", "COLUMNS": "100"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "list"],
        cwd=REPO,
        env=env,
        stdout=slave,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not data:
            break
        out += data
    _, err = proc.communicate(timeout=120)
    os.close(master)
    lines = out.decode().splitlines()
    assert proc.returncode == 0
    assert len(lines) == 1 + 9  # the header, and the screen's 12 lines less 3
    assert err.strip() == "… 991 more sessions (kvchat list --all, or --limit N)"


def test_export_all_writes_every_session_privately(big_home, tmp_path):
    home, _ = big_home
    out = tmp_path / "exports"
    result = run_cli_here(home, "export", "--all", "-o", str(out), "--format", "json")
    files = sorted(out.iterdir())
    ids = {item["id"] for item in run_cli_here(home, "list", "--json").json}
    assert {f.name for f in files} == {f"{i}.json" for i in ids} and len(files) == SESSIONS
    assert result.stderr.strip() == f"wrote 1,000 sessions to {out}"
    assert out.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in files} == {0o600}
    assert all('"messages"' in f.read_text() for f in files[:5])


def test_export_all_refuses_a_link_in_the_folder(big_home, tmp_path):
    home, _ = big_home
    out = tmp_path / "exports"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    first = run_cli_here(home, "list", "--json", "--limit", "1").json[0]["id"]
    (out / f"{first}.md").symlink_to(victim)
    result = run_cli_here(home, "export", "--all", "-o", str(out), check=False)
    assert result.returncode == 2 and f"cannot write {out / first}.md" in result.stderr
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["export", "--all"], "give the folder with -o DIR"),
        (["export", "--all", "abc", "-o", "x"], "name none"),
        (["export", "--all", "-o", "x", "--format", "bundle"], "one session at a time"),
        (["export"], "name the session to export"),
    ],
)
def test_export_all_says_what_it_needs(big_home, tmp_path, args, said):
    home, _ = big_home
    result = run_cli_here(home, *args, check=False)
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


def test_import_on_a_terminal_draws_a_bar_and_takes_it_away(tmp_path):
    export = tmp_path / "conversations.json"
    write_chatgpt_export(export, 30, 2)
    master, slave = os.openpty()
    env = {**clean_env(), "KVCHAT_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "import", str(export)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    err = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        err += data
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    text = err.decode()
    assert proc.returncode == 0 and len(out.splitlines()) == 30
    assert "█" in text and "conversations," in text and "messages" in text
    assert text.endswith("\r\x1b[K")  # the bar is gone before the import's own lines
