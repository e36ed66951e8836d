"""Compaction without a model (issue 42): where the summary goes in a prompt (after the
system prompt and documents, before the kept messages, for templates with a system role and
for Gemma's, which folds the system text into the first user turn), which messages a summary
stands for, what the window's view says, the summaries' rows, and exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.service.context_window import SUMMARY_HEADER, after_summary, with_summary
from kvchat.service.documents import system_message
from kvchat.service.exports import export_session
from kvchat.service.reports import WindowView
from kvchat.store import Store
from tests.unit.service.test_document_placement import CharEngine


def text_of(tokens: list[int]) -> str:
    return "".join(map(chr, tokens))


@pytest.mark.parametrize("folds", [False, True], ids=["system-role", "gemma-folds-system"])
@pytest.mark.parametrize("system", ["Be brief.", None], ids=["system-prompt", "none"])
def test_the_summary_goes_after_the_system_prompt_and_documents_before_the_kept_messages(
    folds: bool, system: str | None
) -> None:
    engine = CharEngine(folds=folds)
    head = with_summary(system_message(system, "DOCS"), "They named the cat Tom.")
    kept = [
        {"role": "user", "content": "KEPT QUESTION"},
        {"role": "assistant", "content": "KEPT REPLY"},
    ]
    text = text_of(engine.chat_tokens(head + kept))
    order = [text.index(part) for part in ("DOCS", SUMMARY_HEADER, "Tom.", "KEPT QUESTION")]
    if system:
        order.insert(0, text.index(system))
    assert order == sorted(order)
    if folds:  # no system turn: it all opens the first user turn
        assert text.startswith("<u>") and text.count("<u>") == 1
    else:
        assert text.startswith("<s>") and text.index("</s>") < text.index("KEPT QUESTION")


def test_without_a_system_message_the_summary_is_one() -> None:
    assert with_summary([], "S") == [{"role": "system", "content": f"{SUMMARY_HEADER}\nS"}]
    head = [{"role": "system", "content": "Be brief."}]
    assert with_summary(head, "S") == [
        {"role": "system", "content": f"Be brief.\n\n{SUMMARY_HEADER}\nS"}
    ]
    assert head == [{"role": "system", "content": "Be brief."}]  # not changed in place


def store_with(tmp_path: Path, exchanges: int) -> tuple[Store, str]:
    store = Store(tmp_path / "kv.db")
    session = store.create_session("Chat", "Be brief.")
    for i in range(exchanges):
        store.add_message(session.id, "user", f"question {i}")
        store.add_message(session.id, "assistant", f"answer {i}")
    return store, session.id


def test_a_summary_stands_for_the_messages_up_to_its_id(tmp_path: Path) -> None:
    store, session_id = store_with(tmp_path, 3)
    history = store.messages(session_id)
    assert after_summary(history, None) == (history, 0)
    summary = store.add_summary(session_id, history[3].id, "Q0-Q1", 40)
    kept, summarized = after_summary(history, summary)
    assert (kept, summarized) == (history[4:], 4)
    assert store.current_summary(session_id) == summary
    later = store.add_summary(session_id, history[5].id, "all of it", 60)
    assert store.current_summary(session_id) == later  # the newest is the one read
    assert store.summaries(session_id) == [summary, later]  # the earlier kept as history


def test_a_summary_names_one_of_its_sessions_messages_or_is_not_stored(tmp_path: Path) -> None:
    store, session_id = store_with(tmp_path, 1)
    other = store.create_session("Other", None)
    foreign = store.add_message(other.id, "user", "elsewhere")
    with pytest.raises(KvchatError, match="has no message"):
        store.add_summary(session_id, foreign.id, "S", 10)
    assert store.summaries(session_id) == []


def test_summaries_go_with_their_session(tmp_path: Path) -> None:
    store, session_id = store_with(tmp_path, 2)
    store.add_summary(session_id, store.messages(session_id)[1].id, "S", 10)
    store.delete_session(session_id)
    assert store.conn.execute("SELECT count(*) FROM summaries").fetchone()[0] == 0


@pytest.mark.parametrize("overflow", ["compact", "drop"])
def test_the_view_says_where_the_window_starts_and_warns_before_it_drops(overflow: str) -> None:
    full = WindowView(2048, 2003, 16, 37, 36, 0, True, overflow)
    assert full.gauge() == "ctx 2,003/2,048 (+16 reply) !"
    assert full.divider() == "the model sees from here; 36 earlier messages are kept but not read"
    warning = full.warning() or ""
    assert warning.startswith("the context is nearly full")
    assert ("/compact" in warning) == (overflow == "compact")
    summarized = WindowView(2048, 1200, 16, 79, 78, 78, False, overflow)
    assert summarized.warning() is None and summarized.gauge().endswith("reply)")
    assert summarized.divider() == (
        "the model sees from here, with a summary of the 78 earlier messages (kept, not read)"
    )
    both = WindowView(2048, 2000, 16, 99, 90, 78, True, overflow)
    assert both.divider() == (
        "the model sees from here; 90 earlier messages are kept but not read "
        "(78 of them summarized)"
    )
    assert WindowView(2048, 100, 16).divider() is None
    assert WindowView().gauge() == ""


def test_exports_carry_the_summary_after_the_last_message_it_stands_for(tmp_path: Path) -> None:
    store, session_id = store_with(tmp_path, 3)
    history = store.messages(session_id)
    store.add_summary(session_id, history[3].id, "They asked *twice*.\n## not a heading", 40)
    session, summaries = store.get_session(session_id), store.summaries(session_id)
    exported = json.loads(export_session(session, history, "json", summaries=summaries))
    assert len(exported["messages"]) == 1 + 6  # the system prompt, then every message
    (summary,) = exported["summaries"]
    assert summary["after"] == 4 and summary["upto_message_id"] == history[3].id
    assert summary["replaced_tokens"] == 40
    markdown = export_session(session, history, "md", summaries=summaries)
    assert markdown.index("answer 1") < markdown.index("## Summary") < markdown.index("question 2")
    assert "instead of messages 1-4 (40 tokens)" in markdown
    assert "\n## not a heading" not in markdown  # the summary's text is contained
    page = export_session(session, history, "html", summaries=summaries)
    assert page.index("answer 1") < page.index('class="msg summary"') < page.index("question 2")
    assert "<em>twice</em>" in page  # its Markdown rendered as a message's is


def test_a_branch_keeps_the_summaries_of_the_messages_it_copies(tmp_path: Path) -> None:
    store, session_id = store_with(tmp_path, 3)
    history = store.messages(session_id)
    store.add_summary(session_id, history[1].id, "first", 10)
    store.add_summary(session_id, history[3].id, "second", 20)
    whole = store.create_session("Whole", None)
    for m in history:
        store.add_message(whole.id, m.role, m.content)
    assert store.copy_summaries(session_id, whole.id) == 2
    copies = store.messages(whole.id)
    assert [(s.upto_message_id, s.text) for s in store.summaries(whole.id)] == [
        (copies[1].id, "first"),
        (copies[3].id, "second"),
    ]
    early = store.create_session("Early", None)
    for m in history[:3]:  # a branch at message #3: the second summary is beyond it
        store.add_message(early.id, m.role, m.content)
    store.add_message(early.id, "user", "an edited question")  # the branch's own
    assert store.copy_summaries(session_id, early.id, added=1) == 1
    assert [s.text for s in store.summaries(early.id)] == ["first"]
