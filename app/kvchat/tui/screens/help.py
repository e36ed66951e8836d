"""F1: every key of the app, from the one key table; long descriptions wrap, the list
scrolls (a terminal of any width shows every word)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label

from kvchat.tui.keys import KEYS


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,f1,q", "close", "Close", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(classes="dialog-screen")

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall", id="help"):
            yield Label("kvchat keys", classes="dialog-title")
            with VerticalScroll(id="keys"):
                for key in KEYS:
                    with Horizontal(classes="key-row"):
                        yield Label(key.label, classes="key-label", markup=False)
                        yield Label(key.description, classes="key-action", markup=False)
            yield Label(
                "Every action is also in the command palette (Ctrl+P) · Esc closes",
                classes="dialog-hint",
            )

    def action_close(self) -> None:
        self.dismiss(None)
