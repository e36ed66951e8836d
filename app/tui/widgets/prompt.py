"""The multi-line message input: Enter sends, Ctrl+J or Shift+Enter inserts a new line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = frozenset({"ctrl+j", "shift+enter", "alt+enter", "ctrl+enter"})


class PromptInput(TextArea):
    """A TextArea whose Enter key submits instead of inserting a line break."""

    @dataclass
    class Submitted(Message):
        prompt: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt

    def take_sent(self, sent: str) -> None:
        """Remove ``sent``, the text Enter just sent, from the input: what was typed after
        Enter stays. Text that is not exactly what was sent is never removed."""
        index = self.text.find(sent) if sent else -1
        if index < 0:
            return
        document = self.document
        start = document.get_location_from_index(index)
        end = document.get_location_from_index(index + len(sent))
        self.delete(start, end)
        if not self.text.strip():  # only the blank around what was sent is left
            self.clear()

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
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
