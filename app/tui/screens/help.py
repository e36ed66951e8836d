"""F1: every key of the app, from the one key table."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

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
            table: DataTable[str] = DataTable(
                id="keys", cursor_type="row", zebra_stripes=True, show_cursor=False
            )
            table.add_columns("Key", "Action")
            for key in KEYS:
                table.add_row(key.label, key.description)
            yield table
            yield Label(
                "Every action is also in the command palette (Ctrl+P) · Esc closes",
                classes="dialog-hint",
            )

    def action_close(self) -> None:
        self.dismiss(None)
