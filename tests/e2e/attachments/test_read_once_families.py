"""Read once with the families whose KV can't be cut anywhere: Gemma 3 270M (a sliding
window, and a template that folds the system prompt into the first user turn) and a tiny
hybrid model (LFM2: a recurrent state beside attention, saved whole).

The first conversation about a document saves its reading where the template starts the
question (for Gemma inside the first user turn, after the documents); the second restores
exactly that prefix (the window or the recurrent state at its end, where nothing needs
cutting), decodes only its question, counted by llama.cpp, and replies as a full prefill.
The expected prefix is computed here from the templates written out by hand and llama.cpp's
own tokenizer, not from kvchat's rendering."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest

from kvchat.config import load_settings
from kvchat.engine import common_prefix
from kvchat.engine.llama import weight_repack
from kvchat.service.chat import ChatService
from tests.e2e.attachments.test_read_once import chatml_tokens, manual
from tests.e2e.families.test_families import gemma3_270m
from tests.tiny_models import write_family

FIRST = "Which valve opens at the highest pressure?"
SECOND = "What colour is the valve in room 12?"
LINES = 25  # about 700 tokens: Gemma 3 270M reads it in well under a minute here
BLOCK = f'<document name="valves.txt" kind="text">\n{manual(LINES)}\n</document>'


def gemma_tokens(model: Path, question: str) -> list[int]:
    """Gemma 3's prompt for one question about the documents: no system turn, the system
    text (here the block) opens the first user turn."""
    text = f"<bos><start_of_turn>user\n{BLOCK}\n\n{question}<end_of_turn>\n<start_of_turn>model\n"
    with weight_repack(False):
        vocab = llama_cpp.Llama(str(model), n_ctx=64, vocab_only=True, verbose=False)
    return vocab.tokenize(text.encode(), add_bos=False, special=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family("lfm2", tmp_path_factory.mktemp("tiny-lfm2") / "lfm2.gguf")


# Gemma 3 270M reads for ~10 s of CPU here: under stress (its resume past the window and the
# read-once proof on SmolLM2 run by default); the tiny hybrid family by default.
@pytest.fixture(params=[pytest.param("gemma3-270m", marks=pytest.mark.stress), "lfm2"])
def family(
    request: pytest.FixtureRequest,
) -> tuple[list[str], Callable[[str], list[int]]]:
    """The model flags of a family and its prompt's tokens for a question."""
    if request.param == "gemma3-270m":
        model = request.getfixturevalue("gemma3_270m")
        flags = ["--model", str(model), "--chat-template", "gemma"]
        return flags, lambda question: gemma_tokens(model, question)
    model = request.getfixturevalue("hybrid")  # SmolLM2's tokenizer and ChatML template
    return ["--model", str(model)], lambda question: chatml_tokens(BLOCK, question)


def batch_align(home: Path, model_flags: list[str]) -> int:
    """Where the engine the CLI opens for these flags can start a prefill (repacked weights
    decode in tiles of 4, or 16 with AMX; 1 otherwise): this machine's answer."""
    options = dict(zip(model_flags[::2], model_flags[1::2], strict=True))
    settings = load_settings(
        model=options["--model"], n_ctx=2048, chat_template=options.get("--chat-template")
    )
    service = ChatService(settings, home=home)
    try:
        engine = service.engine.token_level()
        assert engine is not None
        return max(1, engine.batch_align)
    finally:
        service.close()


def test_the_second_conversation_restores_the_reading_and_decodes_only_its_question(
    kvhome: Path, copy_home, cli, tmp_path: Path, family
) -> None:
    model_flags, tokens_for = family
    flags = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "2048", "--json"]
    flags += [*model_flags, "--threads", "1"]
    document = tmp_path / "valves.txt"
    document.write_text(manual(LINES) + "\n")
    first = cli(kvhome, "ask", "--new", "-a", str(document), FIRST, *flags).json
    assert first["restore"]["from"] == "none"
    with sqlite3.connect(kvhome / "kvchat.db") as db:
        ((reading, reading_tokens),) = db.execute(
            "SELECT session_id, n_tokens FROM kv_snapshots WHERE length(session_id) = 24"
        ).fetchall()

    baseline_home = copy_home(kvhome, "baseline")
    second = cli(kvhome, "ask", "--new", "-a", str(document), SECOND, *flags).json
    baseline = cli(
        baseline_home, "ask", "--new", "-a", str(document), SECOND, "--no-restore", *flags
    ).json

    wanted = tokens_for(SECOND)
    question_at = common_prefix(tokens_for("a"), tokens_for("b"))
    assert question_at == common_prefix(tokens_for(FIRST), wanted)  # the question starts there
    align = batch_align(tmp_path / "align-home", model_flags)
    shared = question_at - question_at % align  # where the engine can start a prefill
    assert reading_tokens == shared > 600
    assert second["tokens"]["prompt"] == baseline["tokens"]["prompt"] == len(wanted)
    assert second["restore"]["from"] == "disk", second["restore"]["reason"]
    # The reading, or the first conversation that continued it (it shares a little more).
    assert second["restore"]["donor"] in (reading, first["session"])
    assert second["restore"]["tokens"] == second["tokens"]["reused"] == shared
    assert second["tokens"]["decoded"] == len(wanted) - shared < 24
    assert baseline["tokens"]["reused"] == 0
    assert second["reply"] == baseline["reply"] and second["tokens"]["generated"] > 0


__all__ = ["gemma3_270m"]  # the fixture (tests/e2e/families/test_families.py)
