"""F3: a message's details: its number, time and tokens, and for a reply generated
in this run the figures of its turn."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label


class DetailsDialog(ModalScreen[None]):
    """Plain lines of ``label: value``; Esc, Enter or F3 closes it (no letter: a sentence
    typed on would close it and lose its first letter)."""

    BINDINGS = [Binding("escape,enter,f3", "close", "Close", show=False)]

    def __init__(self, title: str, lines: list[str]) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.lines = title, lines

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="details"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            for line in self.lines:
                yield Label(line, classes="details-line", markup=False)
            yield Label("Esc closes", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)

    @property
    def text(self) -> str:
        """Everything the dialog says, for tests."""
        return "\n".join([self.title_text, *self.lines])
