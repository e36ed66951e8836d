"""The watch on other processes: what another kvchat writes to the open session shows up.

Every ``WATCH_S`` seconds, while no reply is being generated here, the screen asks the
watch to look: the store thread reads when the open session last changed (one row by its
key). Only when that moved are its messages read, and shown again if they differ from
what is on screen (a ``kvchat ask --session`` from a shell, or a second app: its reply
shows as it is saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.tui.main.context import ScreenContext
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.signals import SessionsChanged

if TYPE_CHECKING:
    from kvchat.service.chat import MessageWindow

WATCH_S = 2.0


class SessionWatch:
    """Looks for changes other processes made to the open session (see the module docstring)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener

    @property
    def due(self) -> bool:
        """Whether a look makes sense now: the model is up, no reply runs, a session is open."""
        state = self.ctx.state
        return state.ready and state.turn is None and state.session_id is not None

    async def check(self) -> None:
        """Show the open session again when another process changed it."""
        state, backend = self.ctx.state, self.ctx.backend
        session_id = state.session_id
        if session_id is None or state.shown_id != session_id:
            return  # not shown yet: opening it reads it afresh
        try:
            stamp = await backend.on_store(backend.chat.sessions.changed_at, session_id)
        except KvchatError:
            return  # deleted meanwhile: the sidebar's refresh shows that
        if state.seen_change == (session_id, stamp):
            return
        try:
            # The count and the last message: never the whole session.
            latest: MessageWindow = await backend.on_store(
                backend.chat.reader.message_window, session_id, 1
            )
        except KvchatError:
            return
        if state.turn is not None or state.session_id != session_id:
            return  # a turn started meanwhile: it shows the store's truth when done
        state.seen_change = (session_id, stamp)
        if self._matches(latest):
            return
        added = latest.total - self._shown_count()
        await self.opener.show_stored(session_id, lazy=False)
        if added > 0:
            plural = "s" if added != 1 else ""
            self.ctx.status.set_turn(f"{added} new message{plural} from another kvchat")
        else:
            self.ctx.status.set_turn("messages updated by another kvchat")
        self.ctx.post(SessionsChanged())

    def _shown_count(self) -> int:
        conversation = self.ctx.conversation
        shown = len(conversation.views) + len(conversation.pending)
        return conversation.first + shown + conversation.later

    def _matches(self, latest: MessageWindow) -> bool:
        """The screen shows the session as ``latest`` reads it: as many messages, and the
        last one shown alike."""
        if latest.total != self._shown_count():
            return False
        conversation = self.ctx.conversation
        views = conversation.views
        if not views or conversation.later or not latest.messages:
            return True
        last, stored = views[-1], latest.messages[-1]
        return (last.role, last.text, last.partial) == (stored.role, stored.content, stored.partial)
