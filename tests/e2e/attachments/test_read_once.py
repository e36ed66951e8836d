"""A document is read once for every conversation about it.

Documents given when a conversation starts render as one block after the system prompt, so
every conversation started with the same documents has the same token prefix: the first
reads it, every later one restores it and decodes only its own question (counted by
llama.cpp), and its greedy reply equals a full prefill's.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from kvchat.engine import common_prefix
from kvchat.engine.llama import weight_repack
from kvchat.paths import bundled_model_path
from tests.conftest import run_cli_here

# Greedy, short replies; room for a ~3,000-token document.
FLAGS = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "4096", "--json"]
FIRST = "Which valve opens at the highest pressure?"
SECOND = "What colour is the valve in room 12?"


def manual(lines: int = 105) -> str:
    """A plain-text document of about 28 tokens a line (~3,000 tokens at 105 lines)."""
    colours = ("red", "blue", "green", "amber", "grey", "white", "black")
    return "\n".join(
        f"Item {i}: the {colours[i % len(colours)]} valve in room {i * 7 % 101} opens at "
        f"{i * 13 % 97} kPa and closes after {i % 9 + 1} minutes."
        for i in range(1, lines + 1)
    )


def chatml_tokens(document_block: str, question: str) -> list[int]:
    """The bundled model's prompt for one question about the documents, tokenized by
    llama.cpp itself (SmolLM2's ChatML: the block is the system message)."""
    text = (
        f"<|im_start|>system\n{document_block}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    with weight_repack(False):
        vocab = llama_cpp.Llama(str(bundled_model_path()), n_ctx=64, verbose=False)
    return vocab.tokenize(text.encode(), add_bos=False, special=True)


# About 730 tokens: sharing is exact at any size (kvchat bench --docs measures 2,000-8,000).
LINES = 25


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "valves.txt"
    path.write_text(manual(LINES) + "\n")
    return path


@pytest.fixture(scope="module")
def first_read(
    tmp_path_factory: pytest.TempPathFactory, document: Path
) -> tuple[Path, dict[str, Any]]:
    """A home where the first conversation about the document read it (the one full read
    both tests start from; each works on a copy)."""
    home = tmp_path_factory.mktemp("first-read") / "home"
    first = run_cli_here(home, "ask", "--new", "-a", str(document), FIRST, *FLAGS).json
    return home, first


def test_a_second_conversation_restores_the_document_and_decodes_only_its_question(
    first_read: tuple[Path, dict[str, Any]], copy_home, cli, document: Path
) -> None:
    source, first = first_read
    assert first["restore"]["from"] == "none"
    assert first["tokens"]["decoded"] == first["tokens"]["prompt"] > 600
    (read,) = first["documents"]
    assert read["name"] == "valves.txt" and read["tokens"] > 600

    home = copy_home(source, "second")
    baseline_home = copy_home(source, "baseline")
    second = cli(home, "ask", "--new", "-a", str(document), SECOND, *FLAGS).json
    baseline = cli(
        baseline_home, "ask", "--new", "-a", str(document), SECOND, "--no-restore", *FLAGS
    ).json

    block = f'<document name="valves.txt" kind="text">\n{manual(LINES)}\n</document>'
    wanted = chatml_tokens(block, SECOND)
    shared = common_prefix(chatml_tokens(block, FIRST), wanted)
    assert second["tokens"]["prompt"] == len(wanted)
    assert second["restore"]["from"] == "disk"
    assert second["restore"]["tokens"] == second["tokens"]["reused"] == shared
    assert second["tokens"]["decoded"] == len(wanted) - shared < 24
    assert second["session"] != first["session"]
    assert baseline["tokens"]["reused"] == 0
    assert second["reply"] == baseline["reply"] and second["tokens"]["generated"] > 0


def test_ten_conversations_about_one_document_store_its_kv_once(
    first_read: tuple[Path, dict[str, Any]], copy_home, cli, document: Path
) -> None:
    source, first = first_read
    home = copy_home(source, "ten")
    reports = [first] + [
        cli(home, "ask", "--new", "-a", str(document), f"Question {n}: which room?", *FLAGS).json
        for n in range(1, 10)
    ]
    assert [r["restore"]["from"] for r in reports] == ["none"] + ["disk"] * 9
    with sqlite3.connect(home / "kvchat.db") as db:
        assert db.execute("SELECT COUNT(*) FROM sessions WHERE length(id) = 8").fetchone()[0] == 10
        stored = db.execute("SELECT COALESCE(SUM(n_bytes), 0) FROM kv_chunks").fetchone()[0]
        per_token = db.execute(
            "SELECT n_bytes * 1.0 / n_tokens FROM kv_chunks ORDER BY n_tokens DESC LIMIT 1"
        ).fetchone()[0]
    document_tokens = reports[1]["restore"]["tokens"]
    own_tokens = sum(r["tokens"]["prompt"] + r["tokens"]["generated"] for r in reports)
    own_tokens -= document_tokens * len(reports)
    assert stored <= per_token * (1.1 * document_tokens + own_tokens)
