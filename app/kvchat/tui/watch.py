"""The watch on other processes: what another kvchat writes to the open session shows up.

A mixin of MainScreen. Every ``WATCH_S`` seconds, while no reply is being generated here,
housekeeping left pending runs (see replies), and the store thread reads when the open session last changed (one row by its key). Only when
that moved are its messages read, and shown again if they differ from what is on screen
(a ``kvchat ask --session`` from a shell, or a second app: its reply shows as it is saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase

if TYPE_CHECKING:
    from kvchat.service.chat import Message

WATCH_S = 2.0


class SessionWatch(ScreenBase):
    """Polls the open session for changes made by other processes (see the module docstring)."""

    def start_watch(self) -> None:
        self.set_interval(WATCH_S, self._watch_tick)

    def _watch_tick(self) -> None:
        if self.ready and self.turn is None:
            # Housekeeping a user's action made yield (and no turn dropped) runs again.
            self.start_housekeeping()
        if self.ready and self.turn is None and self.session_id is not None:
            self.check_for_changes()

    @work(group="watch", exclusive=True, exit_on_error=False)
    async def check_for_changes(self) -> None:
        """Show the open session again when another process changed it."""
        session_id = self.session_id
        if session_id is None or self._shown_id != session_id:
            return  # not shown yet: opening it reads it afresh
        try:
            stamp = await self.on_store(self.service.changed_at, session_id)
        except KvchatError:
            return  # deleted meanwhile: the sidebar's refresh shows that
        if self.seen_change == (session_id, stamp):
            return
        messages: list[Message] = await self.on_store(self.service.messages, session_id)
        if self.turn is not None or self.session_id != session_id:
            return  # a turn started meanwhile: it shows the store's truth when done
        self.seen_change = (session_id, stamp)
        if self._matches(messages):
            return
        added = len(messages) - self._shown_count()
        await self._show_stored(session_id, lazy=False)
        if added > 0:
            plural = "s" if added != 1 else ""
            self.status.set_turn(f"{added} new message{plural} from another kvchat")
        else:
            self.status.set_turn("messages updated by another kvchat")
        self.request_refresh()

    def _shown_count(self) -> int:
        conversation = self.conversation
        shown = len(conversation.views) + len(conversation.pending)
        return conversation.first + shown + conversation.later

    def _matches(self, messages: list[Message]) -> bool:
        """The screen shows ``messages``: as many, and the last one shown alike."""
        if len(messages) != self._shown_count():
            return False
        conversation = self.conversation
        views = conversation.views
        if not views or conversation.later:
            return True
        last, stored = views[-1], messages[-1]
        return (last.role, last.text, last.partial) == (stored.role, stored.content, stored.partial)
