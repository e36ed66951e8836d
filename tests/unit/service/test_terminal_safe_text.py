"""A streamed reply reaches a terminal without control sequences, and titles derived from a
message carry no control characters. Model-free."""

from __future__ import annotations

import sys

import pytest

from kvchat.cli.commands import _stream
from kvchat.text import visible
from tests.e2e.text.test_text_stays_text import ESCAPES


def test_a_streamed_reply_reaches_a_terminal_without_control_sequences(
    monkeypatch: pytest.MonkeyPatch,
):
    written: list[str] = []

    class Terminal:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> None:
            written.append(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Terminal())
    for piece in ("Hi", "\x1b", "[2J", ESCAPES, " there\n"):
        _stream(piece)
    assert "".join(written) == "Hi[2J there\n"  # a split sequence loses its ESC: inert
    assert visible(ESCAPES) == ""


def test_titles_derived_from_a_message_carry_no_control_characters():
    from kvchat.text import short_title  # what a turn titles a new session with

    assert short_title(f"Hello{ESCAPES}\n\tworld") == "Hello world"
