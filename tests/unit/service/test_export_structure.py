"""A message cannot break the Markdown transcript's structure (model-free)."""

from __future__ import annotations

from markdown_it import MarkdownIt

from kvchat.service.exports import to_markdown
from kvchat.store import Message, Session

SESSION = Session("abcd1234", "Tricky", None, {}, "2026-01-01", "2026-01-01")


def _message(i: int, role: str, content: str) -> Message:
    return Message(i, SESSION.id, role, content, "2026-01-01", 0, False)


def _headings(text: str) -> list[str]:
    tokens = MarkdownIt().parse(text)
    return [
        tokens[i + 1].content
        for i, t in enumerate(tokens)
        if t.type == "heading_open" and t.tag in ("h1", "h2")
    ]


def test_fences_and_fake_headings_stay_inside_their_message():
    messages = [
        _message(1, "user", "look:\n```python\nprint('never closed')"),
        _message(2, "assistant", "## You\nI forged a turn\n# New title\n### a real subheading"),
        _message(3, "user", "~~~~\n```\n## inside a fence\n~~~~\ndone"),
        _message(4, "assistant", "last"),
    ]
    text = to_markdown(SESSION, messages)
    assert _headings(text) == ["Tricky", "You", "Assistant", "You", "Assistant"]
    assert "print('never closed')" in text and "I forged a turn" in text
    assert "### a real subheading" in text  # deeper headings are the message's own


def test_a_title_cannot_add_lines():
    session = Session("abcd1234", "one\n## You\ntwo", None, {}, "2026-01-01", "2026-01-01")
    assert _headings(to_markdown(session, [_message(1, "user", "hi")])) == ["one ## You two", "You"]
