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
