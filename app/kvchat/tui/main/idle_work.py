"""Housekeeping after a reply: the settle (the reply read again as the next prompt will
have it) and the snapshot write, run on the engine thread while the user is idle.

A turn returns as soon as its reply is stored (the service's ``defer_housekeeping``); what
it left runs here, one at a time, while no reply runs and no action of the user's is in
flight. Any new action makes it yield at its next batch (see ``Backend.on_engine``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.tui.main.context import HOUSEKEEPING, ScreenContext
from kvchat.tui.main.signals import SessionsChanged
from kvchat.tui.phrases import snapshot_phrase

if TYPE_CHECKING:
    from kvchat.service.chat import SnapshotWrite, TurnReport
    from kvchat.service.reports import Housekeeping


class IdleWork:
    """Starts and runs the housekeeping a turn left (see the module docstring)."""

    def __init__(self, ctx: ScreenContext) -> None:
        self.ctx = ctx
        self.running = False  # a housekeep() queued or running on the engine thread

    @property
    def idle(self) -> bool:
        """No housekeeping runs here, and the last turn left none pending."""
        service = self.ctx.backend.service
        pending = service is not None and service.upkeep.pending
        return not self.running and not pending

    def start(self) -> None:
        """Run what the last turn left, when it may run now (see :meth:`claim`)."""
        actions = self.claim()
        if actions is not None:
            self.ctx.run(HOUSEKEEPING, self.run, actions)

    def claim(self) -> int | None:
        """When housekeeping is pending and may run now (no reply, no action of the user's
        in flight): mark it running and return the count of actions it must not outlive;
        else None."""
        backend, state = self.ctx.backend, self.ctx.state
        service = backend.service
        if (
            service is None
            or self.running
            or not state.ready
            or state.turn is not None
            or backend.engine_jobs
            or backend.closing
            or not service.upkeep.pending
        ):
            return None
        self.running = True
        return backend.engine_actions

    async def run(self, actions: int) -> None:
        """Housekeep on the engine thread (after :meth:`claim`), then show what was done."""
        state = self.ctx.state
        report = state.last_report
        try:
            # Straight onto the engine thread, not on_engine: that would make it yield to itself.
            ran = await self.ctx.backend.engine_thread.run(self._engine_housekeep, actions)
        finally:
            self.running = False
        if ran is None or self.ctx.backend.closing:
            return
        done, used = ran
        if report is not None and report is state.last_report:
            # The figures of the turn that left it (the details dialog shows them).
            if done.snapshot is not None:
                report.snapshot = done.snapshot
            if done.finished and done.note:
                report.window_note = done.note
            if state.turn is None and report.session_id == state.session_id == state.hot_id:
                # The settle left the context holding the next prompt up to the user's words.
                self.ctx.status.set_context(used)
                self.ctx.post(SessionsChanged())
        if done.snapshot is not None:
            self._show_snapshot(done.snapshot, report)

    def _engine_housekeep(self, actions: int) -> tuple[Housekeeping, int] | None:
        """On the engine thread; nothing when an action of the user's was queued meanwhile
        (it runs first; the idle poll tries again after it). With the context's size after."""
        if actions != self.ctx.backend.engine_actions:
            return None
        service = self.ctx.backend.chat
        done = service.upkeep.run_pending()
        return done, service.context_tokens

    def _show_snapshot(self, snapshot: SnapshotWrite, report: TurnReport | None) -> None:
        """The status bar's memory part says what was written (as after a turn that saved)."""
        state = self.ctx.state
        if (
            report is not None
            and report is state.last_report
            and report.session_id == state.session_id
            and state.last_restore is report.restore  # no restore (a switch) since
        ):
            self.ctx.status.set_memory(f"KV: hot · {snapshot_phrase(snapshot)}", "hot")
        if snapshot.error:
            self.ctx.app.notify(snapshot.error, severity="warning", markup=False)
