"""Compaction on a template with no system role (issue 42): Gemma 3 270M folds the system
text into the first user turn, so the summary opens it, after the system prompt and before
the first kept message; the turn after decodes only its own message, and greedy equals a
full prefill of the compacted prompt (a sliding-window model: the compacted prompt is read
whole, not cut from the old KV)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.engine import common_prefix
from tests.e2e.families.test_families import gemma3_270m
from tests.helpers import greedy_service

__all__ = ["gemma3_270m"]  # the fixture (tests/e2e/families/test_families.py)

SUMMARY = "They named the cat Tom and agreed it likes fish."


def test_gemma_places_the_summary_inside_the_first_user_turn(
    gemma3_270m: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    service = greedy_service(
        home, model=gemma3_270m, chat_template="gemma", n_ctx=1024, max_tokens=8
    )
    try:
        session = service.sessions.new_session(system_prompt="Be brief.")
        for i in range(4):
            service.sessions.add_message(session.id, "user", f"Question {i} about the cat?")
            service.sessions.add_message(session.id, "assistant", f"Answer {i}: it purrs.")
        plan = service.compaction.plan(session.id)
        assert plan.kept == 2  # on demand: all but the last exchange
        service.compaction.accept(plan, SUMMARY)
        engine = service.host.token_engine()
        held = list(engine.tokens)
        text = engine.llm.detokenize(held, special=True).decode()  # type: ignore[attr-defined]
        first_turn = (
            "<start_of_turn>user\nBe brief.\n\nSummary of the earlier conversation:\n"
            f"{SUMMARY}\n\nQuestion 3 about the cat?<end_of_turn>\n"
        )
        assert first_turn in text and "system" not in text
        assert text.index(first_turn) < text.index("Answer 3: it purrs.")
        report = service.send(session.id, "And its name?")
        prompt = report.tokens.prompt
        shared = common_prefix(held, engine.tokens[:prompt])
        # The engine starts a prefill where it can (whole tiles of repacked weights).
        assert shared - engine.batch_align < report.tokens.reused <= shared, engine.batch_align
        assert report.tokens.decoded == prompt - report.tokens.reused
        own = engine.count_tokens("And its name?")
        assert own <= report.tokens.decoded <= own + 8 + engine.batch_align
        again = service.regenerate(session.id, no_restore=True)
        assert again.tokens.reused == 0 and again.tokens.decoded == prompt
        assert again.reply == report.reply
    finally:
        service.close()
