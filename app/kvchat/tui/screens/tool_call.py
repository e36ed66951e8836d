"""The dialog that asks about one tool call: the tool, what it does, its arguments, and
three answers (once, always for this tool, deny). Esc denies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Button, Label, SelectionList, Static
from textual.widgets.selection_list import Selection

from kvchat.text import one_line, visible
from kvchat.tui.screens.dialogs import Dialog

if TYPE_CHECKING:
    from kvchat.service.tools import CallRequest, Decision

# The arguments shown at most (the rest is cut with a note; the call gets them all).
SHOWN_ARGUMENT_CHARS = 4000


class ToolCallDialog(Dialog):
    """Allow a tool call once (o, Enter), always for this tool in this conversation (a: kept
    with the session), or deny it (d, Esc)."""

    BINDINGS = [
        Binding("o", "answer('once')", "Once", show=False),
        Binding("a", "answer('always')", "Always", show=False),
        Binding("d", "answer('deny')", "Deny", show=False),
    ]

    def __init__(self, request: CallRequest) -> None:
        super().__init__(classes="dialog-screen")
        self.request = request

    def compose(self) -> ComposeResult:
        request = self.request
        who = "The model calls" if request.by_model else "Call"
        arguments = visible(request.arguments_json)
        if len(arguments) > SHOWN_ARGUMENT_CHARS:
            cut = len(arguments) - SHOWN_ARGUMENT_CHARS
            arguments = f"{arguments[:SHOWN_ARGUMENT_CHARS]}\n… {cut:,} more characters"
        with Vertical(classes="dialog", id="tool-call"):
            yield Label(
                f"{who} {one_line(request.qualified)}", classes="dialog-title", markup=False
            )
            if request.description:
                yield Label(
                    one_line(request.description)[:300], classes="dialog-detail", markup=False
                )
            with VerticalScroll(id="tool-arguments"):
                yield Static(arguments, markup=False, id="tool-arguments-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Once (o)", variant="primary", id="once")
                yield Button("Always in this chat (a)", id="always")
                yield Button("Deny (d)", variant="error", id="deny")

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    def action_answer(self, decision: Decision) -> None:
        self.dismiss(decision)

    def action_cancel(self) -> None:
        self.dismiss("deny")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        event.stop()
        answer: Decision = "once"
        if event.button.id in ("always", "deny"):
            answer = "always" if event.button.id == "always" else "deny"
        self.dismiss(answer)


class ToolsDialog(Dialog):
    """The tool servers (one line each) and their tools, checked where on for this session:
    Space turns one on or off, Ctrl+S or Save keeps the choice, Esc leaves it as it was.
    Dismisses with the qualified names that are on (None: cancelled)."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", show=False)]

    def __init__(self, servers: list[str], tools: list[tuple[str, bool]], note: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.servers, self.tools, self.note = servers, tools, note

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="tools"):
            yield Label("Tools for this session", classes="dialog-title")
            for line in self.servers:
                yield Label(one_line(line), classes="dialog-detail", markup=False)
            if self.tools:
                yield SelectionList[str](
                    *(Selection(Content(one_line(name)), name, on) for name, on in self.tools),
                    id="tool-list",
                )
            if self.note:
                yield Label(one_line(self.note), classes="dialog-hint", markup=False)
            yield Label(
                "Space turns a tool on or off · Ctrl+S saves · Esc cancels", classes="dialog-hint"
            )
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        if self.tools:
            self.query_one("#tool-list", SelectionList).focus()

    def action_save(self) -> None:
        chosen = self.query("#tool-list")
        on = set(chosen.first(SelectionList).selected) if chosen else set()
        self.dismiss(on)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
