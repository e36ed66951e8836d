"""A reply's figures kept with it (issue 41, item 8) on a real SQLite file: recorded for a
message that exists, replaced by a later turn's, gone with the message, and read back only
as values kvchat could have written."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.kvcache import RestoreResult
from kvchat.service.reports import TokenCounts, TurnReport, figure_lines, figures_of
from kvchat.store import Store
from kvchat.store.figures_sql import MessageFigures


@pytest.fixture
def store(tmp_path: Path):
    opened = Store(tmp_path / "kvchat.db")
    yield opened
    opened.close()


def _report(message_id: int) -> TurnReport:
    return TurnReport(
        session_id="s",
        reply="Hi",
        tokens=TokenCounts(prompt=120, reused=100, decoded=20, generated=40),
        restore=RestoreResult("disk", ms=12, bytes=1, tokens=100),
        ttft_ms=250.0,
        tokens_per_s=40.0,
        finish_reason="stop",
        message_id=message_id,
    )


def test_figures_are_kept_with_the_reply_and_go_with_it(store):
    session = store.create_session("Figures")
    store.add_message(session.id, "user", "Hi", token_count=3)
    reply = store.add_message(session.id, "assistant", "Hello", token_count=40)
    figures = figures_of(_report(reply.id), "SmolLM2-135M-Instruct.Q4_1")
    assert figures.seconds == pytest.approx(0.25 + 40 / 40.0)
    store.record_figures(reply.id, figures)
    kept = store.message_figures(reply.id)
    assert kept is not None and kept.recorded
    assert (kept.model, kept.prompt_tokens, kept.reused, kept.decoded, kept.generated) == (
        "SmolLM2-135M-Instruct.Q4_1",
        120,
        100,
        20,
        40,
    )
    assert kept.kv == "restored 100 tokens from disk in 12 ms"
    assert figure_lines(kept) == [
        "Model: SmolLM2-135M-Instruct.Q4_1",
        "Generated: 40 tokens at 40.0 tok/s in 1.2 s",
        "First token after: 250 ms",
        "Prompt: 120 tokens (100 reused, 20 decoded)",
        "KV: restored 100 tokens from disk in 12 ms",
    ]
    # A later turn on the same reply (continued, regenerated) replaces them.
    store.record_figures(reply.id, MessageFigures(model="other", generated=7))
    assert store.message_figures(reply.id).generated == 7  # type: ignore[union-attr]
    store.delete_message(reply.id)
    assert store.message_figures(reply.id) is None
    count = store.conn.execute("SELECT COUNT(*) FROM message_figures").fetchone()[0]
    assert count == 0


def test_no_figures_for_a_message_that_is_not_there(store):
    store.record_figures(12345, MessageFigures(model="x"))
    assert store.message_figures(12345) is None


def test_figures_not_written_by_kvchat_read_as_unknown(store):
    session = store.create_session("Odd")
    reply = store.add_message(session.id, "assistant", "Hello", token_count=4)
    store.record_figures(reply.id, MessageFigures(model="m"))
    store.conn.execute(
        "UPDATE message_figures SET generated=-5, prompt_tokens='many', tokens_per_s=1e300,"
        " ttft_ms=-1, seconds=X'00', model=X'41', decoded=1.5 WHERE message_id=?",
        (reply.id,),
    )
    store.conn.commit()
    kept = store.message_figures(reply.id)
    assert kept == MessageFigures(model="", recorded=kept.recorded)  # type: ignore[union-attr]
    assert figure_lines(kept)[1] == "Generated: not reported tokens"  # type: ignore[arg-type]


def test_counts_of_uncounted_messages_are_kept_and_every_list_sees_them(store):
    session = store.create_session("Imported")
    a = store.add_message(session.id, "user", "Hello there", token_count=0)
    b = store.add_message(session.id, "assistant", "General Kenobi", token_count=0)
    store.add_message(session.id, "user", "", token_count=0)  # nothing to count
    c = store.add_message(session.id, "user", "counted", token_count=2)
    assert store.uncounted_messages(session.id, 10) == [
        (a.id, "Hello there"),
        (b.id, "General Kenobi"),
    ]
    assert store.uncounted_messages(session.id, 1) == [(a.id, "Hello there")]
    before = store.get_session(session.id)
    stamp = store.change_stamp()
    store.keep_token_counts(session.id, {a.id: 3, b.id: 4, c.id: 99})  # c keeps its own
    assert store.uncounted_messages(session.id, 10) == []
    [summary] = store.list_sessions_page(5).sessions
    assert summary.tokens == 3 + 4 + 2 == summary.size
    assert store.get_session(session.id).updated == before.updated
    assert [s.session.id for s in store.sessions_changed_since(stamp).changed] == [session.id]
    store.check_session(session.id)  # the row's sum agrees with its messages
