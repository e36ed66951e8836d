"""Turns on the main screen: send, regenerate, continue a cut reply; the reply streams in.

A mixin of MainScreen. The model runs on the engine thread, which buffers the reply's
pieces in the turn's sink; the UI draws them ``FLUSH_HZ`` times a second.

Enter takes the message out of the input at once (what is typed afterwards stays there) and
shows it as pending while the store thread commits it, under the session's turn lock, even
when the engine thread is still busy; the turn then answers the stored message. A message
that is not sent after all (another kvchat process runs a turn on the session, or it cannot
fit the context) goes back into the input, above anything typed since.

The user never waits for housekeeping: a turn returns as soon as its reply is stored
(the service's ``defer_housekeeping``), and the re-decode of the reply (the settle) and
the snapshot write run afterwards on the engine thread, while the app is idle. Any new
action (see ``ScreenBase.on_engine``) makes them yield at their next batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.format import restore_phrase, saved_phrase, snapshot_phrase
from kvchat.tui.widgets.conversation import MessageView

if TYPE_CHECKING:
    from kvchat.service.chat import SnapshotWrite, TurnReport
    from kvchat.service.reports import Housekeeping

# Streamed tokens are buffered by the engine thread and drawn this often.
FLUSH_HZ = 25
CONTINUE_HINT = "F12 continues it"
# How long storing a message waits for the session's turn lock while this app's own engine
# work (housekeeping yielding, a restore) may hold it; else a turn's usual wait.
OWN_WORK_WAIT_S = 60.0


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
    before: str = ""  # a continued reply: its text before this turn
    asked: MessageView | None = None  # a send: the user's message, pending until stored
    # The prompt being read, from the engine thread: (read, to read, seconds so far).
    progress: tuple[int, int, float] | None = None
    message_id: int | None = None  # a send: the user's message once stored


class TurnActions(ScreenBase):
    """Send, regenerate, continue and stop replies (see the module docstring)."""

    def submit(self, text: str) -> None:
        """Enter in the input: send ``text``, which left the input as Enter was pressed
        (anything typed since stays there); it shows as pending until it is stored. A
        message that cannot be sent now goes back to the input (see the module docstring)."""
        typed, text = text, text.strip()
        if not text:
            return
        if not self.ready:
            self.prompt.give_back(typed)
            self.notify("The model is still loading; your message is kept", severity="warning")
            return
        if self.turn is not None:
            self.prompt.give_back(typed)
            self.notify("Wait for the reply, or press Esc to stop it", severity="warning")
            return
        self.turn = ActiveTurn("send", self.session_id, text)
        self.run_turn(self.turn)

    def action_regenerate(self) -> None:
        if not self.idle_or_say():
            return
        views = self.conversation.views
        if self.session_id is None or not views:
            self.notify("Nothing to regenerate yet", severity="warning")
            return
        self.turn = ActiveTurn("regenerate", self.session_id, None)
        self.run_turn(self.turn)

    def action_continue_reply(self) -> None:
        """F12: go on with the last reply (one cut at the token limit) from the hot KV."""
        if not self.idle_or_say():
            return
        views = self.conversation.views
        if self.session_id is None or not views or views[-1].role != "assistant":
            self.notify("Nothing to continue: the session does not end with a reply")
            return
        if self.conversation.later:
            self.notify("Go to the latest messages first (↓ on the last one shown)")
            return
        self.turn = ActiveTurn("continue", self.session_id, None)
        self.run_turn(self.turn)

    async def _busy_elsewhere(self, turn: ActiveTurn) -> bool:
        """True (and said) when another process runs a turn on the turn's session."""
        if turn.session_id is None:
            return False
        # On the engine thread: behind this app's own turn work, which holds the lock too.
        holder = await self.on_engine(self.service.turn_holder, turn.session_id)
        if holder is None:
            return False
        self.turn = None
        kept = "; your message is kept" if turn.kind == "send" else ""
        self.status.set_turn("another kvchat is replying in this session", "warning")
        self.notify(f"{holder}{kept}", severity="warning", markup=False)
        return True

    async def _post(self, turn: ActiveTurn) -> bool:
        """Show the user's message as pending and store it on the store thread, without
        waiting for the engine; False (the text back in the input, and said) when refused."""
        assert turn.text is not None
        if turn.session_id is None:
            turn.session_id = self.session_id = await self._new_session_id()
            self._shown_id = turn.session_id
            self.request_refresh()
        if self.conversation.later:  # a jump left the latest messages out: back to them
            await self.show_latest()
        turn.asked = await self.conversation.add(MessageView("user", turn.text, pending=True))
        service = self.service
        # This app's own engine work may hold the session's lock: housekeeping lets go of it
        # at its next batch; a restore or other action finishes first.
        own_work = self._housekeeping or self._engine_jobs > 0
        service.interrupt_housekeeping()
        wait = {"wait_s": OWN_WORK_WAIT_S} if own_work else {}
        try:
            message = await self.on_store(service.post, turn.session_id, turn.text, **wait)
        except KvchatError as exc:
            self.turn = None
            self.prompt.give_back(turn.text)
            await turn.asked.remove()
            # The interrupt above had no turn after it: housekeeping may run again.
            self.on_engine(service.allow_housekeeping)
            self._say_not_sent(exc)
            return False
        turn.message_id = message.id
        turn.asked.set_stored(message.id)
        return True

    def _say_not_sent(self, exc: KvchatError) -> None:
        """Say why a message went back to the input."""
        from kvchat.service.reports import MessageRefused  # the service is loaded: no import cost

        busy = isinstance(exc, MessageRefused) and exc.busy
        if busy:
            self.status.set_turn("another kvchat is replying in this session", "warning")
        else:
            self.status.set_turn("not sent: your message is back in the input", "error")
        reason = exc.reason if isinstance(exc, MessageRefused) else str(exc)
        self.notify(
            f"{reason}; your message is back in the input",
            severity="warning" if busy else "error",
            markup=False,
        )

    @work(group="turn", exit_on_error=False)
    async def run_turn(self, turn: ActiveTurn) -> None:
        conversation = self.conversation
        try:
            if turn.kind != "send" and await self._busy_elsewhere(turn):
                return
            if turn.kind == "send":
                if not await self._post(turn):
                    return
            if conversation.later:  # a jump left the latest messages out: back to them
                await self.show_latest()
            for view in conversation.views:
                view.set_cut(False)
            if turn.kind == "regenerate":
                views = conversation.views
                if views and views[-1].role == "assistant":
                    await views[-1].remove()
            if turn.kind == "continue":
                turn.view = conversation.views[-1]
                turn.before = turn.view.text
            else:
                turn.view = await conversation.add(MessageView("assistant", streaming=True))
            turn.view.start_stream()
            self.status.set_turn("reading the prompt…  (Esc stops)", "busy")
            assert self._flusher is not None
            self._flusher.resume()
            try:
                report, used = await self.on_engine(self._engine_turn, turn)
            finally:
                self._flusher.pause()
                await self._flush()
        except Exception as exc:
            # The service committed what it could; show the store's truth, then report.
            self.turn = None
            self._hot_id = None
            # A message not stored, or refused by its turn, goes back to the input.
            given_back = turn.kind == "send" and (turn.message_id is None or _refused(exc))
            if given_back:
                assert turn.text is not None
                self.prompt.give_back(turn.text)
                if turn.asked is not None and turn.asked.is_mounted:
                    await turn.asked.remove()
            self.status.set_turn(str(exc) or type(exc).__name__, "error")
            if turn.view is not None and turn.view.stream is not None:
                await turn.view.stream.stop()
            if turn.session_id is not None and turn.session_id == self.session_id:
                await self._show_stored(turn.session_id, lazy=False)
            self.request_refresh()
            if not isinstance(exc, KvchatError):
                raise  # a bug: the worker-error handler reports it
            if given_back:
                self._say_not_sent(exc)
            else:
                self.notify(str(exc), severity="error", markup=False)
            return
        self.turn = None
        self.last_turn = turn
        await self._finish_turn(turn, report, used)

    def _engine_turn(self, turn: ActiveTurn) -> tuple[TurnReport, int]:
        service = self.service
        assert turn.session_id is not None
        on_token, cancel = turn.sink.append, turn.cancel.is_set

        def read(done: int, total: int, seconds: float) -> None:
            turn.progress = (done, total, seconds)  # one assignment: drawn by _flush

        service.prefill_progress = read
        try:
            return self._engine_turn_run(turn, on_token, cancel)
        finally:
            service.prefill_progress = None

    def _engine_turn_run(
        self, turn: ActiveTurn, on_token: Callable[[str], None], cancel: Callable[[], bool]
    ) -> tuple[TurnReport, int]:
        service = self.service
        assert turn.session_id is not None
        if turn.kind == "send":
            assert turn.message_id is not None
            report = service.answer(
                turn.session_id, turn.message_id, on_token=on_token, cancel=cancel
            )
        elif turn.kind == "continue":
            report = service.continue_reply(turn.session_id, on_token=on_token, cancel=cancel)
        else:
            report = service.regenerate(turn.session_id, on_token=on_token, cancel=cancel)
        return report, service.context_tokens

    async def _flush(self) -> None:
        """Move buffered pieces from the engine thread into the Markdown stream."""
        turn = self.turn
        if turn is None or turn.view is None:
            return
        chunks: list[str] = []
        while turn.sink:
            chunks.append(turn.sink.popleft())
        if not chunks:
            if not turn.pieces and not turn.cancel.is_set() and turn.progress is not None:
                from kvchat.service.reports import reading_phrase  # loaded with the service already

                self.status.set_turn(f"{reading_phrase(*turn.progress)}  (Esc stops)", "busy")
            return
        turn.pieces += len(chunks)
        if not turn.cancel.is_set():
            self.status.set_turn(f"generating · {turn.pieces:,} tokens  (Esc stops)", "busy")
        await turn.view.write("".join(chunks))

    async def _finish_turn(self, turn: ActiveTurn, report: TurnReport, used: int) -> None:
        view = turn.view
        assert view is not None
        self.last_report = report
        self._hot_id = turn.session_id
        if report.message_id is None and turn.kind == "continue":
            await view.finish(text=turn.before, message_id=view.message_id, partial=view.partial)
        elif report.message_id is None:
            await view.finish(text="", message_id=None, partial=True)
            await view.remove()
            if report.finish_reason == "cancelled":
                self.notify("Stopped before the first token: no reply to keep")
        else:
            self.turn_figures[report.message_id] = report
            text = turn.before + report.reply if turn.kind == "continue" else report.reply
            await view.finish(
                text=text,
                message_id=report.message_id,
                partial=report.partial,
                finish_reason=report.finish_reason,
            )
        if view.message_id is not None:
            view.set_version(*await self.on_store(self.service.reply_versions, view.message_id))
        cut = report.finish_reason == "length" and view.message_id is not None
        view.set_cut(cut)
        summary = report.summary() + (f" · {CONTINUE_HINT}" if cut else "")
        self.status.set_turn(summary, "warning" if report.partial or cut else "")
        self.status.set_context(used)
        # The memory part says what happened to the KV last: this turn's restore, else
        # what was saved (the snapshot write after the reply updates it), never an earlier
        # turn's or the opening's figure.
        restore = report.restore
        self.last_restore = restore
        if restore.source in ("disk", "ram", "server"):
            self.status.set_memory(f"KV: {restore_phrase(restore)}", restore.source)
        else:
            self.status.set_memory(f"KV: hot · {saved_phrase(report)}", "hot")
        if report.snapshot.error:
            self.notify(report.snapshot.error, severity="warning", markup=False)
        self.request_refresh()
        self.start_housekeeping()  # the settle and the snapshot write, unless a message waits

    # --- housekeeping after a reply -------------------------------------------------------

    @property
    def housekeeping_idle(self) -> bool:
        """No housekeeping runs here, and the last turn left none pending."""
        service = self.kv_app.service
        pending = service is not None and service.housekeeping_pending
        return not self._housekeeping and not pending

    def start_housekeeping(self) -> None:
        """Run what the last turn left (the settle, the snapshot write) on the engine thread,
        one at a time, while no reply runs and no action of the user's is in flight."""
        service = self.kv_app.service
        if (
            service is None
            or self._housekeeping
            or not self.ready
            or self.turn is not None
            or self._engine_jobs
            or self.kv_app.closing
            or not service.housekeeping_pending
        ):
            return
        self._housekeeping = True
        self._housekeep(self._engine_actions)

    @work(group="housekeeping", exit_on_error=False)
    async def _housekeep(self, actions: int) -> None:
        report = self.last_report
        try:
            # Straight onto the engine thread, not on_engine: that would make it yield to itself.
            ran = await self.kv_app.engine_thread.run(self._engine_housekeep, actions)
        finally:
            self._housekeeping = False
        if ran is None or self.kv_app.closing:
            return
        done, used = ran
        if report is not None and report is self.last_report:
            # The figures of the turn that left it (the details dialog shows them).
            if done.snapshot is not None:
                report.snapshot = done.snapshot
            if done.finished and done.note:
                report.window_note = done.note
            if self.turn is None and report.session_id == self.session_id == self._hot_id:
                # The settle left the context holding the next prompt up to the user's words.
                self.status.set_context(used)
                self.request_refresh()
        if done.snapshot is not None:
            self._show_snapshot(done.snapshot, report)

    def _engine_housekeep(self, actions: int) -> tuple[Housekeeping, int] | None:
        """On the engine thread; nothing when an action of the user's was queued meanwhile
        (it runs first; the idle poll tries again after it). With the context's size after."""
        if actions != self._engine_actions:
            return None
        done = self.service.housekeep()
        return done, self.service.context_tokens

    def _show_snapshot(self, snapshot: SnapshotWrite, report: TurnReport | None) -> None:
        """The status bar's memory part says what was written (as after a turn that saved)."""
        if (
            report is not None
            and report is self.last_report
            and report.session_id == self.session_id
            and self.last_restore is report.restore  # no restore (a switch) since
        ):
            self.status.set_memory(f"KV: hot · {snapshot_phrase(snapshot)}", "hot")
        if snapshot.error:
            self.notify(snapshot.error, severity="warning", markup=False)

    @work(group="action", exit_on_error=False)
    async def switch_version(self, view: MessageView, step: int) -> None:
        """←/→ on the last reply: make its previous / next version current and show it."""
        if not self._idle("switch a reply's version"):
            return
        views = self.conversation.views
        if view.message_id is None or not views or view is not views[-1]:
            self.notify("Only the last reply has versions to switch (Ctrl+R makes a new one)")
            return
        try:
            # On the engine thread: it takes the session's turn lock, like a turn.
            message = await self.on_engine(self.service.switch_version, view.message_id, step)
        except KvchatError as exc:
            self.notify(str(exc), severity="warning", markup=False)
            return
        if message is None:
            edge = "first" if step < 0 else "last"
            self.notify(f"This is the {edge} version of the reply (Ctrl+R makes a new one)")
            return
        position, count = await self.on_store(self.service.reply_versions, message.id)
        await view.show_version(message, position, count)
        self.status.set_turn(
            f"reply version {position} of {count}: the next message reuses the KV up to it"
        )
        self.request_refresh()

    def action_cancel(self) -> None:
        """Esc: stop the reply; the engine thread sees the flag between tokens."""
        if self.turn is not None and not self.turn.cancel.is_set():
            self.turn.cancel.set()
            self.status.set_turn("stopping…", "busy")
        elif self.focused is not self.prompt:
            self.prompt.focus()


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says the user's message was not sent (it goes back to the input)."""
    from kvchat.service.reports import MessageRefused  # the service is loaded: no import cost

    return isinstance(exc, MessageRefused)
