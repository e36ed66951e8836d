"""The multi-line message input: Enter sends, Ctrl+J or Shift+Enter inserts a new line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = frozenset({"ctrl+j", "shift+enter", "alt+enter", "ctrl+enter"})


class PromptInput(TextArea):
    """A TextArea whose Enter key submits instead of inserting a line break.

    With ``takes_sent`` (the message input), Enter also empties it at once, in the same
    step that reads the text: a key typed straight after Enter (even one the terminal
    delivers before the screen hears of the Enter) lands in the empty input and is never
    mistaken for part of the message. A message that is not sent after all is handed back
    with :meth:`give_back`.
    """

    def __init__(self, *args: Any, takes_sent: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.takes_sent = takes_sent

    @dataclass
    class Submitted(Message):
        prompt: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt

    @dataclass
    class Pasted(Message):
        """Text was pasted into the input (it is inserted as text, as always)."""

        prompt: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt

    def on_paste(self, event: events.Paste) -> None:
        """After TextArea inserted the pasted text: say what was pasted (paths in it are
        offered as attachments)."""
        if not self.read_only and self.takes_sent:
            self.post_message(self.Pasted(self, event.text))

    def give_back(self, text: str) -> None:
        """Put a message that was not sent back at the start of the input, above anything
        typed since (nothing the user wrote is lost)."""
        rest = self.text
        joiner = "\n" if rest.strip() else ""
        self.insert(text + joiner, (0, 0))
        if not rest.strip():
            self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if self.takes_sent:
                if not text.strip():
                    return  # nothing to send: what is there (blank) stays
                self.clear()
            self.post_message(self.Submitted(self, text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
