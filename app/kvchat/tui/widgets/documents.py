"""The documents panel above the message input: the attachments that go with the next
message (each removable), the open session's documents (name, kind, size, tokens, where in
the conversation) and what the last turn with documents reused and decoded. Hidden while
there is nothing to show."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Label

from kvchat.text import one_line


@dataclass(frozen=True)
class DocumentLine:
    """One of the open session's documents, as the panel shows it."""

    name: str
    kind: str
    size: str
    tokens: int | None
    where: str  # "at start" or "with message #N"
    note: str | None = None  # e.g. its file changed on disk since it was read
    in_library: bool = False  # kept by `kvchat docs add`

    def text(self) -> str:
        tokens = f" · {self.tokens:,} tokens" if self.tokens is not None else ""
        kept = " · in the library" if self.in_library else ""
        note = f" · {self.note}" if self.note else ""
        return one_line(
            f"{self.name} · {self.kind} · {self.size}{tokens} · {self.where}{kept}{note}"
        )


@dataclass(frozen=True)
class PendingLine:
    """An attachment waiting for the next message."""

    name: str
    detail: str


class DocumentsPanel(Vertical):
    """See the module docstring; ``lines`` is what it shows, one string a row (tests)."""

    DEFAULT_CSS = """
    DocumentsPanel { height: auto; max-height: 12; margin: 0 1; display: none; }
    DocumentsPanel.-shown { display: block; }
    DocumentsPanel .documents-head { color: $text-muted; width: 1fr; }
    DocumentsPanel .document-pending { height: 1; width: 1fr; }
    DocumentsPanel .document-pending Label { width: 1fr; color: $text-accent; }
    DocumentsPanel .document-pending Button { min-width: 5; height: 1; border: none; }
    DocumentsPanel .document-row { color: $text-muted; width: 1fr; }
    """

    @dataclass
    class Removed(Message):
        """The user took the pending attachment at ``index`` off the next message."""

        index: int

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.pending: list[PendingLine] = []
        self.pending_note = ""
        self.stored: list[DocumentLine] = []
        self.turn_line: str | None = None

    @property
    def lines(self) -> list[str]:
        out = []
        if self.pending:
            out.append(self.pending_note)
            out += [f"{p.name} · {p.detail}" for p in self.pending]
        if self.stored:
            out.append("Documents of this conversation")
            out += [d.text() for d in self.stored]
        if self.turn_line:
            out.append(self.turn_line)
        return out

    def compose(self) -> ComposeResult:
        if self.pending:
            yield Label(one_line(self.pending_note), classes="documents-head", markup=False)
            for index, pending in enumerate(self.pending):
                with Horizontal(classes="document-pending"):
                    yield Label(one_line(f"📎 {pending.name} · {pending.detail}"), markup=False)
                    yield Button("✕", id=f"drop-{index}", tooltip="Remove this attachment")
        if self.stored:
            yield Label("Documents of this conversation", classes="documents-head")
            for line in self.stored:
                yield Label(line.text(), classes="document-row", markup=False)
        if self.turn_line:
            yield Label(one_line(self.turn_line), classes="document-row", markup=False)

    async def show(
        self,
        *,
        pending: list[PendingLine] | None = None,
        pending_note: str | None = None,
        stored: list[DocumentLine] | None = None,
        turn_line: str | None | bool = False,
    ) -> None:
        """Change what is shown (a part not given stays; ``turn_line`` None clears it)."""
        if pending is not None:
            self.pending = pending
        if pending_note is not None:
            self.pending_note = pending_note
        if stored is not None:
            self.stored = stored
        if turn_line is not False:
            self.turn_line = turn_line if isinstance(turn_line, str) else None
        self.set_class(bool(self.pending or self.stored or self.turn_line), "-shown")
        await self.recompose()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        name = event.button.id or ""
        if name.startswith("drop-"):
            self.post_message(self.Removed(int(name.removeprefix("drop-"))))
