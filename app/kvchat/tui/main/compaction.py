"""Compaction in the app (issue 42): ``/compact`` shows what a summary of the older messages
replaces and costs, the model's summary as it is written (Esc stops it), then keeps the
edited summary or drops it; and what the model sees after every turn: the conversation's
divider, the status bar's gauge with the reply reserve, a warning before the next turn would
leave messages out (with ``overflow = "compact"``, the compaction is offered then)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.text import one_line
from kvchat.tui.main.context import Job
from kvchat.tui.main.screen_state import ready_or_say
from kvchat.tui.screens.compaction import CompactionDialog

if TYPE_CHECKING:
    from kvchat.service.compaction import CompactionPlan
    from kvchat.service.reports import WindowView
    from kvchat.tui.main.context import ScreenContext
    from kvchat.tui.main.opener import SessionOpener

COMPACT = Job("compact", "compaction", exclusive=True)
WINDOW = Job("show_window", "window", exclusive=True)


class Compacting:
    """The main screen's ``/compact`` and the window's view (see the module)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener
        self.offered: set[str] = set()  # sessions offered a compaction at overflow, this run
        ctx.slash.register(
            "compact",
            "Summarize the older messages: the model reads the summary instead of them",
            "/compact",
            self._typed,
        )

    # --- what the model sees -----------------------------------------------------------------

    async def show_view(
        self, session_id: str, view: WindowView | None, *, offer: bool = True
    ) -> None:
        """Show a turn's (or an opened session's) window: the divider, the gauge, and the
        warning before the next turn would leave messages out (after a turn, under
        ``overflow = "compact"``, the compaction is offered instead: once per session and
        run, until a turn no longer warns)."""
        if view is None or self.ctx.state.session_id != session_id:
            return
        await self.ctx.conversation.set_window(view.first_message_id, view.divider(), view.summary)
        self.ctx.status.set_window(view.reserve, view.next_drops)
        warning = view.warning()
        if warning is None:
            self.offered.discard(session_id)
            return
        if offer and view.overflow == "compact" and session_id not in self.offered:
            self.offered.add(session_id)
            self.ctx.run(COMPACT, self._compact, session_id)
        else:
            self.ctx.app.notify(warning, severity="warning", timeout=8, markup=False)

    def refresh_view(self, session_id: str) -> None:
        """Compute the open session's window on the engine thread and show it."""
        self.ctx.run(WINDOW, self._refresh_view, session_id)

    async def _refresh_view(self, session_id: str) -> None:
        compaction = self.ctx.backend.chat.compaction
        try:
            view = await self.ctx.backend.on_engine(compaction.loaded_view, session_id)
        except KvchatError:
            return  # the view is a courtesy: the next turn reports its own
        await self.show_view(session_id, view, offer=False)  # opening offers nothing

    # --- /compact ------------------------------------------------------------------------------

    def _typed(self, _arguments: str) -> None:
        session_id = self.ctx.state.session_id
        if session_id is None:
            self.ctx.app.notify("/compact: open a conversation first", severity="warning")
            return
        if not ready_or_say(self.ctx.app, self.ctx.state):
            return
        self.ctx.run(COMPACT, self._compact, session_id)

    async def _compact(self, session_id: str) -> None:
        """Plan, write (cancelable), ask, then keep: the conversation is unchanged until the
        user keeps a summary."""
        app, backend, status = self.ctx.app, self.ctx.backend, self.ctx.status
        compaction = backend.chat.compaction
        try:
            plan: CompactionPlan = await backend.on_engine(compaction.plan, session_id)
        except KvchatError as exc:
            app.notify(one_line(str(exc)), severity="warning", timeout=8, markup=False)
            return
        stop = threading.Event()
        dialog = CompactionDialog(plan.line(), stop.set)
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def answered(text: str | None) -> None:
            if not answer.done():
                answer.set_result(text)

        await app.push_screen(dialog, answered)
        status.set_turn("the model writes a summary of the older messages", "busy")

        def on_token(piece: str) -> None:
            if not stop.is_set():
                app.call_from_thread(dialog.add, piece)

        try:
            draft = await backend.on_engine(
                compaction.draft,
                plan,
                cancel=lambda: stop.is_set() or backend.closing,
                on_token=on_token,
            )
        except KvchatError as exc:
            stop.set()
            if dialog.is_active:
                dialog.dismiss(None)
            status.set_turn(f"not compacted: {one_line(str(exc))}", "warning")
            return
        if not draft.cancelled and not answer.done():
            dialog.written(draft.text, await self._problem(plan, draft.text))
        status.set_turn("", "")
        text = await answer
        while text is not None:
            problem = await self._problem(plan, text)
            if problem is None:
                break
            retry = CompactionDialog(plan.line(), stop.set)
            answer = asyncio.get_running_loop().create_future()
            await app.push_screen(retry, answered)
            retry.written(text, problem)
            text = await answer
        if text is None:
            status.set_turn("not compacted: the conversation is as it was", "")
            return
        status.set_turn("reading the compacted conversation once…", "busy")
        try:
            done = await backend.on_engine(
                compaction.accept, plan, text, cancel=lambda: backend.closing
            )
        except KvchatError as exc:
            status.set_turn(f"not compacted: {one_line(str(exc))}", "error")
            return
        status.set_turn(done.line(), "")
        if self.ctx.state.session_id == session_id:
            await self.opener.show_latest(lazy=True)
            await self.ctx.refresh()
            await self._refresh_view(session_id)

    async def _problem(self, plan: CompactionPlan, text: str) -> str | None:
        """Why ``text`` cannot be kept (empty, not shorter than what it replaces), or None
        (counted on the engine thread)."""
        try:
            await self.ctx.backend.on_engine(self.ctx.backend.chat.compaction.check, plan, text)
        except KvchatError as exc:
            return one_line(str(exc))
        return None
