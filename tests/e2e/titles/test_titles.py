"""After a session's first reply the model names it, beside the conversation: the session's
KV is untouched (the next turn decodes only the new message), generating aside leaves the
conversation as it was, a title the user set is never replaced, and auto_title = false
keeps the first line."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvchat.engine.api import EngineConfig
from kvchat.paths import bundled_model_path
from kvchat.text import TITLE_WORDS, short_title
from tests.helpers import greedy_service

FIRST = "# Plan **a trip** to Japan in spring"
# Long enough that its automatic title is cut ("…"): the bundled model, asked to name a
# conversation whose first message is one short line, may answer with that line itself.
ASKED = (
    "I want to plan a two-week trip to Japan in spring. Where should I go to see the cherry"
    " blossoms, and how do I travel between the cities?"
)


def test_generating_aside_leaves_the_conversation_as_it_was() -> None:
    from kvchat.engine.llama import LlamaEngine

    engine = LlamaEngine(EngineConfig(bundled_model_path(), n_ctx=1024, n_threads=1))
    try:
        engine.prefill(engine.chat_tokens([{"role": "user", "content": "Tell me about cats."}]))
        tokens, state = engine.tokens, hashlib.sha256(bytes(engine.state_get())).hexdigest()
        ask = [{"role": "user", "content": "Name this conversation: cats."}]
        assert engine.generate_aside(engine.chat_tokens(ask), 12)
        assert engine.tokens == tokens
        assert hashlib.sha256(bytes(engine.state_get())).hexdigest() == state
    finally:
        engine.close()


def test_the_model_names_a_session_and_the_next_turn_reads_only_the_new_message(
    kvhome: Path,
) -> None:
    service = greedy_service(kvhome)
    try:
        first = service.start(ASKED)
        title = service.store.get_session(first.session_id).title
        assert title != short_title(ASKED) and 0 < len(title.split()) <= TITLE_WORDS
        hot = service.engine.n_tokens
        again = service.send(first.session_id, "What about food?")
        assert again.restore.source == "hot" and again.tokens.reused == hot
        assert again.tokens.decoded == again.tokens.prompt - hot < 20
        # Only the first reply names a session.
        assert service.store.get_session(first.session_id).title == title
    finally:
        service.close()


def test_a_title_the_user_set_is_kept_and_the_setting_turns_naming_off(kvhome: Path) -> None:
    service = greedy_service(kvhome)
    service.upkeep.deferred = True  # as the app does: naming waits for an idle moment
    try:
        report = service.start("Tell me about cats.")
        service.sessions.rename(report.session_id, "My cats")
        assert service.upkeep.run_pending().title is None
        assert service.store.get_session(report.session_id).title == "My cats"
    finally:
        service.close()
    off = greedy_service(kvhome, auto_title=False)
    try:
        report = off.start(FIRST)
        assert off.store.get_session(report.session_id).title == short_title(FIRST)
    finally:
        off.close()
