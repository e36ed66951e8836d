"""The attach picker: files and folders through Textual's ``DirectoryTree`` (or a typed path),
a glob for folders; what was picked is read off the UI thread, and before anything is
stored the screen shows what it takes (tokens, share of the context, time to read here)
and asks to attach. A path kvchat will not read, or documents too big, is one line here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DirectoryTree, Input, Label

from kvchat.errors import KvchatError
from kvchat.tui.screens.dialogs import Dialog

if TYPE_CHECKING:
    from kvchat.service.documents import ReadDocuments


@dataclass(frozen=True)
class Reading:
    """Documents read and fitted, not stored yet: what the screen shows and hands back."""

    documents: ReadDocuments
    fit_line: str  # tokens, share of the context, time to read here (or why none)
    at_start: bool  # a new conversation's start block (else: with the next message)
    paths: tuple[str, ...] = ()
    glob: str | None = None
    session_id: str | None = None  # the conversation open when they were fitted

    @property
    def names(self) -> str:
        return ", ".join(row.name for row in self.documents.rows)


# Reads paths (with a glob for folders) and fits them: a Reading, or one KvchatError line.
Reader = Callable[[Sequence[str], "str | None"], Awaitable[Reading]]


def size_text(size: int) -> str:
    """A byte count as the picker and the documents panel show it."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KB"
    return f"{size / (1024 * 1024):.1f} MB"


class AttachScreen(Dialog):
    """Pick files or a folder, see what they take, attach (or Esc)."""

    DEFAULT_CSS = """
    AttachScreen #attach-tree { height: 8; margin-bottom: 1; }
    AttachScreen #attach-fields { height: auto; }
    AttachScreen #attach-path { width: 3fr; }
    AttachScreen #attach-glob { width: 2fr; }
    AttachScreen #attach-message { width: 1fr; margin-top: 1; }
    AttachScreen #attach-message.-error { color: $text-error; }
    AttachScreen #attach-buttons { height: auto; margin-top: 1; align-horizontal: right; }
    """

    def __init__(self, reader: Reader, root: Path, preset: Sequence[str] = ()) -> None:
        super().__init__(classes="dialog-screen")
        self.reader = reader
        self.root = root
        self.preset = tuple(preset)
        self.folder: str | None = None  # the folder picked in the tree (read with the glob)
        self.reading: Reading | None = None  # read and fitted: what Attach hands back
        self.message = ""  # what the message line says (tests read it)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Label("Attach files", classes="dialog-title")
            yield DirectoryTree(self.root, id="attach-tree")
            with Horizontal(id="attach-fields"):
                yield Input(placeholder="or a path (Enter reads it)", id="attach-path")
                yield Input(placeholder="glob for a folder: *.py, docs/**/*.md", id="attach-glob")
            yield Label(
                "Enter on a file reads it; on a folder picks it (Read folder reads it)",
                id="attach-message",
                markup=False,
            )
            with Horizontal(id="attach-buttons"):
                yield Button("Read folder", id="attach-read", disabled=True)
                yield Button("Attach", variant="primary", id="attach-ok", disabled=True)
                yield Button("Cancel (Esc)", id="attach-cancel")

    def on_mount(self) -> None:
        if self.preset:
            self._read(list(self.preset), None)
        else:
            self.query_one("#attach-tree", DirectoryTree).focus()

    def say(self, line: str, error: bool = False) -> None:
        self.message = line
        label = self.query_one("#attach-message", Label)
        label.update(line)
        label.set_class(error, "-error")

    def _glob(self) -> str | None:
        return self.query_one("#attach-glob", Input).value.strip() or None

    def _read(self, paths: list[str], glob: str | None) -> None:
        self.reading = None
        self.query_one("#attach-ok", Button).disabled = True
        self.say(f"reading {', '.join(Path(p).name or p for p in paths)}…")
        self.run_worker(
            self._reading(paths, glob), group="attach-read", exclusive=True, exit_on_error=False
        )

    async def _reading(self, paths: list[str], glob: str | None) -> None:
        try:
            reading = await self.reader(paths, glob)
        except KvchatError as exc:
            self.say(_one_line(str(exc)), error=True)
            return
        except Exception as exc:  # a bug: still one line, never a traceback on screen
            self.say(_one_line(f"could not read it: {exc!r}"), error=True)
            return
        self.reading = reading
        notes = (
            f" (skipped: {'; '.join(reading.documents.notes)})" if reading.documents.notes else ""
        )
        self.say(_one_line(f"{reading.names}: {reading.fit_line}{notes}") + " · attach?")
        button = self.query_one("#attach-ok", Button)
        button.disabled = False
        button.focus()

    @on(DirectoryTree.FileSelected)
    def _file(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self._read([str(event.path)], None)

    @on(DirectoryTree.DirectorySelected)
    def _folder(self, event: DirectoryTree.DirectorySelected) -> None:
        event.stop()
        self.folder = str(event.path)
        self.query_one("#attach-read", Button).disabled = False
        self.say(
            f"folder {event.path.name or event.path}: Read folder reads its files (glob above)"
        )

    @on(Input.Submitted, "#attach-path")
    def _typed(self, event: Input.Submitted) -> None:
        typed = event.value.strip()
        if typed:
            self._read([str(Path(typed).expanduser())], self._glob())

    @on(Input.Submitted, "#attach-glob")
    def _glob_entered(self) -> None:
        if self.folder is not None:
            self._read([self.folder], self._glob())

    @on(Button.Pressed, "#attach-read")
    def _read_folder(self) -> None:
        if self.folder is not None:
            self._read([self.folder], self._glob())

    @on(Button.Pressed, "#attach-ok")
    def _attach_pressed(self) -> None:
        if self.reading is not None:
            self.dismiss(self.reading)

    @on(Button.Pressed, "#attach-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class OfferDialog(Dialog):
    """The message names files or folders: attach them, or send the message as typed."""

    def __init__(self, paths: Sequence[str]) -> None:
        super().__init__(classes="dialog-screen")
        self.paths = tuple(paths)

    def compose(self) -> ComposeResult:
        shown = ", ".join(self.paths)
        what = "a file or folder" if len(self.paths) == 1 else "files or folders"
        with Vertical(classes="dialog"):
            yield Label(f"Your message names {what}: attach?", classes="dialog-title")
            yield Label(_one_line(shown), classes="dialog-detail", markup=False)
            yield Label(
                "Attach shows what they take first · Send as typed keeps the text only "
                "(Tab, Enter) · Esc puts the message back",
                classes="dialog-hint",
            )
            with Horizontal(classes="dialog-buttons"):
                yield Button("Attach", variant="primary", id="offer-attach")
                yield Button("Send as typed", id="offer-send")

    # No letter answers it: it opens at Enter, while the user may type on (Enter, or Tab
    # and Enter, picks a button).

    def on_mount(self) -> None:
        self.query_one("#offer-attach", Button).focus()

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss("attach" if event.button.id == "offer-attach" else "send")


def _one_line(text: str, limit: int = 400) -> str:
    from kvchat.text import one_line

    line = one_line(text)
    return line if len(line) <= limit else line[: limit - 1] + "…"
