"""The Markdown parsers messages are drawn with: one of each, shared by every message (a
session switch builds a page of messages), and your own keeps the line breaks you typed
while a reply's soft breaks stay soft, whichever was used first."""

from __future__ import annotations

from kvchat.tui.widgets.message_view import message_parser, user_parser


def test_your_line_breaks_are_kept_and_a_replys_are_not_whichever_parses_first() -> None:
    typed = "first line\nsecond line"
    for _ in range(2):
        assert "<br" in user_parser().render(typed)
        assert "<br" not in message_parser().render(typed)
    assert user_parser() is user_parser() and message_parser() is message_parser()
    assert user_parser() is not message_parser()


def test_markup_of_a_message_is_shown_as_text() -> None:
    html = message_parser().render("Use `Vec<String>` or <b>bold</b> &amp; more")
    assert "<b>bold</b>" not in html and "&amp;amp;" in html
