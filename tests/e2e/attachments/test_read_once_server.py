"""Documents with the other engines, against a real llama-server (no mock).

- ``--server`` (kvchat's llama-server engine): the same sharing as the local engine. The
  first conversation saves the documents' reading as a slot file of its own; the second
  restores it into the slot, decodes only its question (the server's count) and replies
  as a full prefill does.
- ``--openai`` (any OpenAI-compatible server; here llama-server's /v1): the text is sent,
  the server's own prompt cache decides what is reused, and kvchat shows its figure: the
  second conversation's prompt reuses the document the first one left in the slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.engine import common_prefix
from tests.conftest import run_cli_here
from tests.e2e.attachments.test_read_once import chatml_tokens, manual
from tests.e2e.server.test_server import Server

FIRST = "Which valve opens at the highest pressure?"
SECOND = "What colour is the valve in room 12?"
GREEDY = ["--temperature", "0", "--max-tokens", "16"]
LINES = 25
BLOCK = f'<document name="valves.txt" kind="text">\n{manual(LINES)}\n</document>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("docs-server") / "slots", slots=1, n_ctx=4096)
    yield running
    running.stop()


@pytest.fixture
def document(tmp_path: Path) -> Path:
    path = tmp_path / "valves.txt"
    path.write_text(manual(LINES) + "\n")
    return path


def test_with_server_the_reading_is_a_slot_file_the_next_conversation_restores(
    server: Server, document: Path, tmp_path: Path, copy_home
) -> None:
    home = tmp_path / "home"
    flags = [*GREEDY, "--json", "--server", server.url]
    first = run_cli_here(home, "ask", "--new", "-a", str(document), FIRST, *flags).json
    assert first["restore"]["from"] == "none" and first["snapshot"]["error"] is None
    baseline_home = copy_home(home, "baseline")
    second = run_cli_here(home, "ask", "--new", "-a", str(document), SECOND, *flags).json
    baseline = run_cli_here(
        baseline_home, "ask", "--new", "-a", str(document), SECOND, "--no-restore", *flags
    ).json

    wanted = chatml_tokens(BLOCK, SECOND)
    shared = common_prefix(chatml_tokens(BLOCK, "a"), chatml_tokens(BLOCK, "b"))
    assert second["tokens"]["prompt"] == len(wanted)
    assert second["restore"]["from"] == "server", second["restore"]["reason"]
    assert len(second["restore"]["donor"]) == 24  # the reading, not the first conversation
    assert second["restore"]["tokens"] == second["tokens"]["reused"] == shared
    assert second["tokens"]["decoded"] == len(wanted) - shared < 24
    assert baseline["tokens"]["reused"] == 0
    assert second["reply"] == baseline["reply"] and second["tokens"]["generated"] > 0


def test_with_openai_the_text_is_sent_and_the_servers_cached_tokens_are_shown(
    server: Server, document: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    flags = [*GREEDY, "--openai", f"{server.url}/v1"]
    first = run_cli_here(home, "ask", "--new", "-a", str(document), FIRST, "--json", *flags).json
    assert first["remote"]["figures"] == "usage+timings"
    second = run_cli_here(home, "ask", "--new", "-a", str(document), SECOND, *flags)
    wanted = chatml_tokens(BLOCK, SECOND)
    shared = common_prefix(chatml_tokens(BLOCK, FIRST), wanted)
    line = (
        f"valves.txt: sent as text; the server's cache reused {shared:,} prompt tokens (its figure)"
    )
    assert f"kvchat: {line}" in second.stderr
    assert f"prompt {len(wanted):,} tokens, reused {shared:,}" in second.stderr


def test_the_library_reads_ahead_with_kvchats_own_engine_only(
    server: Server, document: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    for flags in (["--server", server.url], ["--openai", f"{server.url}/v1"]):
        refused = run_cli_here(home, "docs", "add", str(document), *flags, check=False)
        assert refused.returncode == 2 and refused.stdout == ""
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith("kvchat: kvchat docs reads documents ahead with kvchat's own")
    assert run_cli_here(home, "docs", "list", "--json").json == {"documents": []}
