"""The typed Messages the main screen's collaborators post to it (the widgets' own live on
the widgets). The screen handles each in one place; ``Fatal`` bubbles on to the app."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kvchat.tui.main.screen_state import ActiveTurn


class SessionsChanged(Message):
    """A session was made, renamed, deleted, answered or made hot: the sidebar reads the
    list again. Replaces one still queued (one read serves both)."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SessionsChanged)


@dataclass
class OpenRequested(Message):
    """Open a session: show its messages (around ``highlight``), then make it hot."""

    session_id: str
    highlight: int | None = None
    focus_prompt: bool = False


@dataclass
class SessionHot(Message):
    """The session's KV is in the context now (a switch, a reopen, a model load)."""

    session_id: str


@dataclass
class TurnRequested(Message):
    """Run ``turn`` (held by the screen's state already): an edit's new branch replies."""

    turn: ActiveTurn


@dataclass
class SendRequested(Message):
    """Send ``text`` as Enter does (a message held while the user chose what to attach)."""

    text: str


class DocumentsChanged(Message):
    """The attachments waiting for the next message, or the open session's documents,
    changed: the documents panel shows them again."""


class TurnEnded(Message):
    """A reply ended and is stored: what it left to do (the settle, the snapshot) may run."""


@dataclass
class Fatal(Message):
    """The data or the model could not be opened: the app shows an error screen."""

    title: str
    detail: str
