"""Drafts: what is typed in the input and not sent yet, kept per session in the store.

Each change of the input is written as the open session's draft once typing pauses for
:data:`DRAFT_SAVE_AFTER_S` (one small transaction on the store thread), so a kill loses at
most that last pause's keys. Switching sessions keeps the input's text as the session
left's draft and shows the opened one's; a relaunch shows the open session's draft again;
quitting writes what is pending at once. Sending empties the input, and with it the draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import TextArea

from kvchat.tui.main.context import SAVE_DRAFTS, ScreenContext

if TYPE_CHECKING:
    from textual.timer import Timer

    from kvchat.service.book import SessionBook

# A draft is written this long after the last change of the input.
DRAFT_SAVE_AFTER_S = 0.5


class Drafts:
    """The open session's draft, debounced into the store (see the module docstring)."""

    def __init__(self, ctx: ScreenContext) -> None:
        self.ctx = ctx
        self.pending: dict[str, str] = {}  # session id -> its draft, not written yet
        self._timer: Timer | None = None

    def _book(self) -> SessionBook | None:
        """Where drafts are kept: the service's sessions (None before it opens)."""
        service = self.ctx.backend.service
        return service.sessions if service is not None else None

    # --- what the screen and the opener call ----------------------------------------------

    def changed(self) -> None:
        """The user changed the input: its text is the open session's draft, written after
        a pause (the input set from a draft is no change: see :meth:`_show`)."""
        session_id = self.ctx.state.session_id
        if session_id is not None:
            self.pending[session_id] = self.ctx.prompt.text
            self._schedule()

    def sent(self) -> None:
        """A message left the input: its session's draft goes now, not after a pause (a kill
        right after Enter must not bring the sent text back as a draft)."""
        session_id = self.ctx.state.session_id
        if session_id is not None:
            self.pending[session_id] = self.ctx.prompt.text
            self.ctx.run(SAVE_DRAFTS, self.save)

    def leave(self, opened: str) -> None:
        """Before ``opened`` becomes the open session: the input's text stays as the draft
        of the session it was typed in, and the input empties (see :meth:`restore`). Text
        typed before any session was open stays in the input, as ``opened``'s."""
        left = self.ctx.state.session_id
        if left is not None and left != opened:
            self.pending[left] = self.ctx.prompt.text
            self._show("")

    async def restore(self, session_id: str) -> None:
        """After ``session_id`` opened: write the drafts pending, then show its stored draft
        in the input unless something was typed there meanwhile (nothing before the store is
        open: at start-up the opener calls this again once it is)."""
        await self.save()
        book = self._book()
        if book is None or session_id in self.pending:
            return
        draft = await self.ctx.backend.on_store(book.draft, session_id)
        if draft and not self.ctx.prompt.text and self.ctx.state.session_id == session_id:
            self._show(draft)

    async def save(self) -> None:
        """Write the pending drafts on the store thread (later if the store is not open)."""
        if not self.pending:
            return
        book = self._book()
        if book is None:
            self._schedule()
            return
        pending, self.pending = self.pending, {}
        try:
            await self.ctx.backend.on_store(book.keep_drafts, pending)
        except BaseException:
            for session_id, text in pending.items():  # kept for the next try
                self.pending.setdefault(session_id, text)
            raise

    def save_now(self) -> None:
        """At quit, on the thread closing the service: write what is pending."""
        book = self._book()
        if book is not None and self.pending:
            pending, self.pending = self.pending, {}
            book.keep_drafts(pending)

    # --- inside ---------------------------------------------------------------------------

    def _show(self, text: str) -> None:
        """Set the input to ``text``, the cursor at its end; not a change the user made."""
        prompt = self.ctx.prompt
        with prompt.prevent(TextArea.Changed):
            prompt.load_text(text)
            prompt.move_cursor(prompt.document.end)

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.ctx.prompt.set_timer(DRAFT_SAVE_AFTER_S, self._due)

    def _due(self) -> None:
        self._timer = None
        self.ctx.run(SAVE_DRAFTS, self.save)
