"""The compaction dialog: what a summary replaces and what it costs, the summary as the
model writes it (then editable), and two answers: keep it (Ctrl+S) or drop it (Esc, which
also stops the model while it writes). Nothing is stored until it is kept."""

from __future__ import annotations

from collections.abc import Callable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Label, TextArea

from kvchat.text import visible
from kvchat.tui.screens.dialogs import Dialog

WRITING = "the model writes the summary… Esc stops it (nothing is stored)"
EDITING = "edit the summary if you like · Ctrl+S keeps it · Esc drops it (nothing is stored)"


class CompactionDialog(Dialog):
    """Dismissed with the summary to keep, or None (dropped, or stopped while written)."""

    BINDINGS = [Binding("ctrl+s", "keep", "Keep", show=False)]

    def __init__(self, cost: str, on_cancel: Callable[[], None]) -> None:
        """``cost``: the plan's line; ``on_cancel``: stops the model writing the summary."""
        super().__init__(classes="dialog-screen")
        self.cost = cost
        self.on_cancel = on_cancel
        self.writing = True

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide", id="compaction-dialog"):
            yield Label("Compact the conversation", classes="dialog-title")
            yield Label(self.cost, classes="dialog-detail", id="compaction-cost", markup=False)
            yield TextArea("", id="summary-text", soft_wrap=True, read_only=True)
            yield Label(WRITING, id="compaction-hint", classes="dialog-hint", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Keep (Ctrl+S)", variant="primary", id="keep", disabled=True)
                yield Button("Drop (Esc)", id="drop")

    @property
    def text(self) -> str:
        return self.query_one("#summary-text", TextArea).text

    def add(self, piece: str) -> None:
        """A piece of the summary as the model writes it (shown without escapes)."""
        area = self.query_one("#summary-text", TextArea)
        area.insert(visible(piece), area.document.end)

    def written(self, text: str, problem: str | None = None) -> None:
        """The model is done: the summary becomes editable (``problem``: why it cannot be
        kept as it is, e.g. empty)."""
        self.writing = False
        area = self.query_one("#summary-text", TextArea)
        area.text = visible(text)  # what is kept is what is shown: no raw escapes
        area.read_only = False
        area.focus()
        self.query_one("#keep", Button).disabled = False
        self.query_one("#compaction-hint", Label).update(problem or EDITING)

    def refuse(self, problem: str) -> None:
        """Say why the summary cannot be kept; the dialog stays open to edit it."""
        self.query_one("#compaction-hint", Label).update(problem)

    def action_keep(self) -> None:
        if not self.writing:
            self.dismiss(self.text)

    def action_cancel(self) -> None:
        self.on_cancel()
        self.dismiss(None)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "keep":
            self.action_keep()
        else:
            self.action_cancel()
