"""What the main screen has open and is doing, in one record its collaborators share.

The screen makes one ``ScreenState`` and hands it to each collaborator in its constructor;
each reads it and writes the fields it owns (see their docstrings). Nothing here runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from textual.app import App

    from kvchat.service.chat import RestoreResult, TurnReport
    from kvchat.service.reasoning import ReasoningStream
    from kvchat.tui.screens.attach import Reading
    from kvchat.tui.widgets.conversation import MessageView


@dataclass
class ActiveTurn:
    """A reply being generated: the engine thread appends to ``sink``; the UI drains it."""

    kind: str  # "send", "regenerate" or "continue"
    session_id: str | None
    text: str | None
    cancel: threading.Event = field(default_factory=threading.Event)
    sink: deque[str] = field(default_factory=deque)
    view: MessageView | None = None
    pieces: int = 0
    started: float = field(default_factory=time.perf_counter)
    # When the first pieces were drawn and how many (the live tok/s counts from there).
    first_drawn: tuple[float, int] | None = None
    before: str = ""  # a continued reply: its text before this turn
    asked: MessageView | None = None  # a send: the user's message, pending until stored
    # The prompt being read, from the engine thread: (read, to read, seconds so far).
    progress: tuple[int, int, float] | None = None
    message_id: int | None = None  # a send: the user's message once stored
    # A continued reply: its reasoning before this turn.
    before_reasoning: str = ""
    # Splits the pieces into reasoning and answer (set on the engine thread, before the
    # first piece, from the model's reasoning style).
    splitter: ReasoningStream | None = None
    # What the reply's reasoning looks like so far, as the UI drew it: its text, tokens,
    # when the first came and how long it lasted (None: still thinking, or never did).
    reasoning: str = ""
    thought_tokens: int = 0
    thought_started: float | None = None
    thought_seconds: float | None = None
    answer_seen: bool = False
    # From the engine thread: why the streaming reply is not being saved now (one line), or
    # None (see kvchat.service.streaming.StreamSaver).
    save_trouble: str | None = None
    # A send: the attachments it carries (stored with the message; see Attachments).
    documents: Reading | None = None
    documents_at_start: bool | None = None  # where they went, once stored


@dataclass
class ScreenState:
    """The open session and what the UI has done for it; the turn running, and the last."""

    session_id: str | None = None
    # What the UI has finished doing for a session: shown its messages / made it hot.
    # An interrupted switch leaves these behind, so the next one redoes the work.
    shown_id: str | None = None
    hot_id: str | None = None
    # The open session and when it last changed, as shown (see SessionWatch).
    seen_change: tuple[str, str] | None = None
    # The model is loaded (and not being switched): messages may be sent.
    ready: bool = False
    # The start-up has drawn the session list's first page and the open session (set by
    # the opener): the list's other pages, read in the background, wait for it.
    painted: asyncio.Event = field(default_factory=asyncio.Event)
    turn: ActiveTurn | None = None
    last_turn: ActiveTurn | None = None
    last_report: TurnReport | None = None
    last_restore: RestoreResult | None = None
    last_switch_ms: float | None = None
    last_jump_ms: float | None = None
    # The figures of the turns of this run, by the id of the reply each produced.
    turn_figures: dict[int, TurnReport] = field(default_factory=dict)
    # Sessions this run made (Ctrl+N, a first message): those left empty go at quit.
    made_sessions: set[str] = field(default_factory=set)
    # Attachments read and fitted, waiting for the next message (owned by Attachments).
    pending_documents: Reading | None = None

    @property
    def open_and_hot(self) -> str | None:
        """The open session when its KV is in the context, else None."""
        return self.hot_id if self.hot_id is not None and self.hot_id == self.session_id else None


def ready_or_say(app: App[Any], state: ScreenState) -> bool:
    """Whether the model is loaded and no reply is being generated; else says to wait."""
    if not state.ready or state.turn is not None:
        app.notify("Wait for the model to be ready and idle", severity="warning")
        return False
    return True


def idle_or_say(app: App[Any], state: ScreenState, what: str) -> bool:
    """True when no reply is being generated; else says that ``what`` has to wait."""
    if state.turn is not None:
        app.notify(f"Cannot {what} during a reply (Esc stops it)", severity="warning")
        return False
    return True
