"""Turns on the main screen: send, regenerate, continue a cut reply; the reply streams in.

The model runs on the engine thread, which buffers the reply's pieces in the turn's sink;
the UI draws them ``FLUSH_HZ`` times a second.

Enter takes the message out of the input at once (what is typed afterwards stays there) and
shows it as pending while the store thread commits it, under the session's turn lock, even
when the engine thread is still busy; the turn then answers the stored message. A message
that is not sent after all (another kvchat process runs a turn on the session, or it cannot
fit the context) goes back into the input, above anything typed since.

The user never waits for housekeeping: a turn returns as soon as its reply is stored
(the service's ``defer_housekeeping``), and the re-decode of the reply (the settle) and
the snapshot write run afterwards on the engine thread, while the app is idle (see
``idle_work``). Any new action (see ``Backend.on_engine``) makes them yield at their next
batch.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.tui.main.context import TURN, ScreenContext
from kvchat.tui.main.idle_work import IdleWork
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.screen_state import ActiveTurn, idle_or_say, ready_or_say
from kvchat.tui.main.signals import DocumentsChanged, SessionsChanged, TurnEnded
from kvchat.tui.phrases import restore_phrase, saved_phrase
from kvchat.tui.widgets.conversation import MessageView
from kvchat.tui.widgets.thought import ThoughtFigures

if TYPE_CHECKING:
    from textual.timer import Timer

    from kvchat.service.chat import TurnReport
    from kvchat.service.reports import WindowView
    from kvchat.service.tools import Approver

# Streamed tokens are buffered by the engine thread and drawn this often.
FLUSH_HZ = 25
CONTINUE_HINT = "F12 continues it"
# How long storing a message waits for the session's turn lock while this app's own engine
# work (housekeeping yielding, a restore) may hold it; else a turn's usual wait.
OWN_WORK_WAIT_S = 60.0


class TurnRunner:
    """Send, regenerate, continue and stop replies (see the module docstring); it owns
    ``state.turn``, ``last_turn``, ``last_report`` and ``turn_figures``."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener, idle_work: IdleWork) -> None:
        self.ctx = ctx
        self.opener = opener
        self.idle_work = idle_work
        # Draws the buffered pieces FLUSH_HZ times a second while a reply streams (the
        # screen makes it, paused, when mounted).
        self.flusher: Timer | None = None
        # Asks the user about each tool call a reply makes (ToolCalls.approver; None: the
        # replies' calls are not run), and how many calls the last turn ran.
        self.tool_approver: Approver | None = None
        self.tool_steps = 0
        # Shows what the model sees after a turn (Compacting.show_view: the divider, the
        # gauge, the warning); None: nothing shown.
        self.on_view: Callable[[str, WindowView | None], Awaitable[None]] | None = None

    def submit(self, text: str) -> ActiveTurn | None:
        """Enter in the input: send ``text``, which left the input as Enter was pressed
        (anything typed since stays there); it shows as pending until it is stored. A
        message that cannot be sent now goes back to the input (see the module docstring)."""
        typed, text = text, text.strip()
        if not text:
            return None
        if not self.ctx.state.ready:
            self.ctx.prompt.give_back(typed)
            self.ctx.app.notify(
                "The model is still loading; your message is kept", severity="warning"
            )
            return None
        if self.ctx.state.turn is not None:
            self.ctx.prompt.give_back(typed)
            self.ctx.app.notify("Wait for the reply, or press Esc to stop it", severity="warning")
            return None
        self.ctx.state.turn = ActiveTurn("send", self.ctx.state.session_id, text)
        # What was attached goes with this message (back to waiting if it is not sent).
        if self.ctx.state.pending_documents is not None:
            self.ctx.state.turn.documents = self.ctx.state.pending_documents
            self.ctx.state.pending_documents = None
            self.ctx.post(DocumentsChanged())
        return self.ctx.state.turn

    def regenerate(self) -> ActiveTurn | None:
        """Ctrl+R: a new version of the last reply."""
        if not ready_or_say(self.ctx.app, self.ctx.state):
            return None
        views = self.ctx.conversation.views
        if self.ctx.state.session_id is None or not views:
            self.ctx.app.notify("Nothing to regenerate yet", severity="warning")
            return None
        self.ctx.state.turn = ActiveTurn("regenerate", self.ctx.state.session_id, None)
        return self.ctx.state.turn

    def continue_reply(self) -> ActiveTurn | None:
        """F12: go on with the last reply (one cut at the token limit) from the hot KV."""
        if not ready_or_say(self.ctx.app, self.ctx.state):
            return None
        views = self.ctx.conversation.views
        if self.ctx.state.session_id is None or not views or views[-1].role != "assistant":
            self.ctx.app.notify("Nothing to continue: the session does not end with a reply")
            return None
        if self.ctx.conversation.later:
            self.ctx.app.notify("Go to the latest messages first (↓ on the last one shown)")
            return None
        self.ctx.state.turn = ActiveTurn("continue", self.ctx.state.session_id, None)
        return self.ctx.state.turn

    async def _busy_elsewhere(self, turn: ActiveTurn) -> bool:
        """True (and said) when another process runs a turn on the turn's session."""
        if turn.session_id is None:
            return False
        # On the engine thread: behind this app's own turn work, which holds the lock too.
        holder = await self.ctx.backend.on_engine(
            self.ctx.backend.chat.sessions.turn_holder, turn.session_id
        )
        if holder is None:
            return False
        self.ctx.state.turn = None
        kept = "; your message is kept" if turn.kind == "send" else ""
        self.ctx.status.set_turn("another kvchat is replying in this session", "warning")
        self.ctx.app.notify(f"{holder}{kept}", severity="warning", markup=False)
        return True

    async def _post(self, turn: ActiveTurn) -> bool:
        """Show the user's message as pending and store it on the store thread, without
        waiting for the engine; False (the text back in the input, and said) when refused."""
        assert turn.text is not None
        if turn.session_id is None:
            turn.session_id = self.ctx.state.session_id = await self.opener.new_session_id()
            self.ctx.state.shown_id = turn.session_id
            self.ctx.post(SessionsChanged())
        if self.ctx.conversation.later:  # a jump left the latest messages out: back to them
            await self.opener.show_latest()
        turn.asked = await self.ctx.conversation.add(MessageView("user", turn.text, pending=True))
        service = self.ctx.backend.chat
        # This app's own engine work may hold the session's lock: housekeeping lets go of it
        # at its next batch; a restore or other action finishes first.
        own_work = self.idle_work.running or self.ctx.backend.engine_jobs > 0
        service.upkeep.interrupt()
        wait = {"wait_s": OWN_WORK_WAIT_S} if own_work else {}
        try:
            if turn.documents is None:
                message = await self.ctx.backend.on_store(
                    service.turns.post, turn.session_id, turn.text, **wait
                )
            else:
                message, turn.documents_at_start = await self.ctx.backend.on_store(
                    service.turns.post_with_documents,
                    turn.session_id,
                    turn.text,
                    turn.documents.documents,
                    **wait,
                )
        except KvchatError as exc:
            self._documents_back(turn)
            self.ctx.state.turn = None
            self.ctx.prompt.give_back(turn.text)
            await turn.asked.remove()
            # The interrupt above had no turn after it: housekeeping may run again.
            self.ctx.backend.on_engine(service.upkeep.allow)
            self._say_not_sent(exc)
            return False
        turn.message_id = message.id
        turn.asked.set_stored(message.id)
        return True

    def _documents_back(self, turn: ActiveTurn) -> None:
        """A message not sent: what was attached to it waits for the next one again."""
        if turn.documents is not None and self.ctx.state.pending_documents is None:
            self.ctx.state.pending_documents = turn.documents
            self.ctx.post(DocumentsChanged())

    def _say_not_sent(self, exc: KvchatError) -> None:
        """Say why a message went back to the input."""
        from kvchat.service.reports import MessageRefused  # the service is loaded: no import cost

        busy = isinstance(exc, MessageRefused) and exc.busy
        if busy:
            self.ctx.status.set_turn("another kvchat is replying in this session", "warning")
        else:
            self.ctx.status.set_turn("not sent: your message is back in the input", "error")
        reason = exc.reason if isinstance(exc, MessageRefused) else str(exc)
        self.ctx.app.notify(
            f"{reason}; your message is back in the input",
            severity="warning" if busy else "error",
            markup=False,
        )

    def start(self, turn: ActiveTurn | None) -> None:
        """Run ``turn`` (from :meth:`submit`, :meth:`regenerate`…; None: nothing to run) in
        a worker of the screen."""
        if turn is not None:
            self.ctx.run(TURN, self.run, turn)

    async def run(self, turn: ActiveTurn) -> None:
        """Post the message (a send), stream the reply in, show how the turn went."""
        conversation = self.ctx.conversation
        try:
            if turn.kind != "send" and await self._busy_elsewhere(turn):
                return
            if turn.kind == "send":
                if not await self._post(turn):
                    return
            if conversation.later:  # a jump left the latest messages out: back to them
                await self.opener.show_latest()
            for view in conversation.views:
                view.set_cut(False)
            if turn.kind == "regenerate":
                views = conversation.views
                if views and views[-1].role == "assistant":
                    await views[-1].remove()
            if turn.kind == "continue":
                turn.view = conversation.views[-1]
                turn.before = turn.view.text
                turn.before_reasoning = turn.view.reasoning
            else:
                turn.view = await conversation.add(MessageView("assistant", streaming=True))
            turn.view.start_stream()
            self.ctx.status.set_turn("reading the prompt…  (Esc stops)", "busy")
            assert self.flusher is not None
            self.flusher.resume()
            try:
                report, used = await self.ctx.backend.on_engine(self._engine_turn, turn)
            finally:
                self.flusher.pause()
                await self.flush()
        except Exception as exc:
            # The service committed what it could; show the store's truth, then report.
            self.ctx.state.turn = None
            self.ctx.state.hot_id = None
            # A message not stored, or refused by its turn, goes back to the input.
            given_back = turn.kind == "send" and (turn.message_id is None or _refused(exc))
            if given_back:
                assert turn.text is not None
                self.ctx.prompt.give_back(turn.text)
                self._documents_back(turn)
                if turn.asked is not None and turn.asked.is_mounted:
                    await turn.asked.remove()
            self.ctx.status.set_turn(str(exc) or type(exc).__name__, "error")
            if turn.view is not None and turn.view.stream is not None:
                await turn.view.stream.stop()
            if turn.session_id is not None and turn.session_id == self.ctx.state.session_id:
                await self.opener.show_stored(turn.session_id, lazy=False)
            self.ctx.post(SessionsChanged())
            if not isinstance(exc, KvchatError):
                raise  # a bug: the worker-error handler reports it
            if given_back:
                self._say_not_sent(exc)
            else:
                self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        self.ctx.state.turn = None
        self.ctx.state.last_turn = turn
        await self._finish_turn(turn, report, used)

    def _engine_turn(self, turn: ActiveTurn) -> tuple[TurnReport, int]:
        service = self.ctx.backend.chat
        assert turn.session_id is not None
        # The model is loaded before any turn; a service whose model is not (a stand-in
        # engine) has no template to read the style from, and reading it would load one.
        if service.host.loaded_model_path is not None:
            turn.splitter = _splitter(service.host.reasoning_style, turn)
        on_token, cancel = turn.sink.append, turn.cancel.is_set

        def read(done: int, total: int, seconds: float) -> None:
            turn.progress = (done, total, seconds)  # one assignment: drawn by flush

        def trouble(line: str | None) -> None:
            turn.save_trouble = line  # one assignment: drawn by flush

        service.turns.prefill_progress = read
        service.turns.save_trouble = trouble
        try:
            return self._engine_turn_run(turn, on_token, cancel)
        finally:
            service.turns.prefill_progress = None
            service.turns.save_trouble = None

    def _engine_turn_run(
        self, turn: ActiveTurn, on_token: Callable[[str], None], cancel: Callable[[], bool]
    ) -> tuple[TurnReport, int]:
        service = self.ctx.backend.chat
        assert turn.session_id is not None
        if turn.kind == "send":
            assert turn.message_id is not None
            tools = service.tools
            tools.attach_configured()
            if self.tool_approver is not None and tools.runner is not None:
                done = tools.answer(  # the reply's tool calls, approved, and the reply after
                    turn.session_id,
                    turn.message_id,
                    self.tool_approver,
                    on_token=on_token,
                    cancel=cancel,
                )
                report, self.tool_steps = done.report, len(done.steps)
                return report, service.context_tokens
            report = service.answer(
                turn.session_id, turn.message_id, on_token=on_token, cancel=cancel
            )
        elif turn.kind == "continue":
            report = service.continue_reply(turn.session_id, on_token=on_token, cancel=cancel)
        else:
            report = service.regenerate(turn.session_id, on_token=on_token, cancel=cancel)
        return report, service.context_tokens

    async def flush(self) -> None:
        """Move buffered pieces from the engine thread into the Markdown stream."""
        turn = self.ctx.state.turn
        if turn is None or turn.view is None:
            return
        chunks: list[str] = []
        while turn.sink:
            chunks.append(turn.sink.popleft())
        if not chunks:
            if not turn.pieces and not turn.cancel.is_set() and turn.progress is not None:
                from kvchat.service.reports import reading_phrase  # loaded with the service already

                self.ctx.status.set_turn(f"{reading_phrase(*turn.progress)}  (Esc stops)", "busy")
            return
        turn.pieces += len(chunks)
        if turn.first_drawn is None:
            turn.first_drawn = (time.perf_counter(), turn.pieces)
        splitter = turn.splitter
        if splitter is None or not splitter.style.thinks:
            answer = "".join(chunks)
        else:
            answer = await self._split(turn, chunks)
        if not turn.cancel.is_set():
            if _thinking(turn):
                what = f"thinking… · {turn.thought_tokens:,} tokens"
            else:
                what = f"generating · {turn.pieces:,} tokens{live_rate(turn)}"
            if turn.save_trouble is not None:  # the database refuses: said, the reply goes on
                self.ctx.status.set_turn(f"{what} · {turn.save_trouble}", "warning")
            else:
                self.ctx.status.set_turn(f"{what}  (Esc stops)", "busy")
        if answer:
            await turn.view.write(answer)

    async def _split(self, turn: ActiveTurn, chunks: list[str]) -> str:
        """Feed a thinking model's pieces to the turn's splitter: the reasoning goes into
        the reply's folded block (its line counting up), the answer is returned."""
        splitter, view = turn.splitter, turn.view
        assert splitter is not None and view is not None
        answer: list[str] = []
        before = (turn.reasoning, _thinking(turn))
        for chunk in chunks:
            reasoning, said = splitter.feed(chunk)
            turn.reasoning += reasoning
            if said:
                answer.append(said)
                turn.answer_seen = True
            now = time.perf_counter()
            if _thinking(turn):
                turn.thought_tokens += 1
                if turn.thought_started is None:
                    turn.thought_started = now
            elif turn.thought_started is not None and turn.thought_seconds is None:
                turn.thought_seconds = now - turn.thought_started
        thinking = _thinking(turn)
        if (turn.reasoning, thinking) != before or thinking:
            await view.set_reasoning(
                turn.before_reasoning + turn.reasoning
                if turn.kind == "continue"
                else turn.reasoning,
                _figures(turn),
                thinking=thinking,
            )
        return "".join(answer)

    async def _finish_turn(self, turn: ActiveTurn, report: TurnReport, used: int) -> None:
        view = turn.view
        assert view is not None
        self.ctx.state.last_report = report
        self.ctx.state.hot_id = turn.session_id
        if report.message_id is None and turn.kind == "continue":
            await view.finish(
                text=turn.before,
                message_id=view.message_id,
                partial=view.partial,
                reasoning=turn.before_reasoning,
            )
        elif report.message_id is None:
            await view.finish(text="", message_id=None, partial=True)
            await view.remove()
            if report.finish_reason == "cancelled":
                self.ctx.app.notify("Stopped before the first token: no reply to keep")
        else:
            self.ctx.state.turn_figures[report.message_id] = report
            splitter = turn.splitter
            if turn.kind != "continue":
                text, reasoning = report.reply, report.reasoning
            elif splitter is not None and splitter.style.thinks:
                # The reply as written, before and after: split as the service stored it.
                text, reasoning = splitter.answer, splitter.reasoning
            else:
                text, reasoning = turn.before + report.reply, turn.before_reasoning
            if turn.kind == "continue":
                view.figures = ThoughtFigures()  # only this turn's part of it was counted
            elif reasoning and turn.thought_tokens:
                view.figures = _figures(turn)
                figured = (report.message_id, reasoning)
                self.ctx.conversation.thought_figures[figured] = view.figures
            await view.finish(
                text=text,
                message_id=report.message_id,
                partial=report.partial,
                finish_reason=report.finish_reason,
                reasoning=reasoning,
            )
        if view.message_id is not None:
            view.set_version(
                *await self.ctx.backend.on_store(
                    self.ctx.backend.chat.sessions.reply_versions, view.message_id
                )
            )
        cut = report.finish_reason == "length" and view.message_id is not None
        view.set_cut(cut)
        summary = report.summary() + (f" · {CONTINUE_HINT}" if cut else "")
        self.ctx.status.set_turn(summary, "warning" if report.partial or cut else "")
        self.ctx.status.set_context(used)
        if self.on_view is not None and turn.session_id is not None:
            await self.on_view(turn.session_id, report.view)
        # The memory part says what happened to the KV last: this turn's restore, else
        # what was saved (the snapshot write after the reply updates it), never an earlier
        # turn's or the opening's figure.
        restore = report.restore
        self.ctx.state.last_restore = restore
        if restore.source in ("disk", "ram", "server"):
            self.ctx.status.set_memory(f"KV: {restore_phrase(restore)}", restore.source)
        else:
            self.ctx.status.set_memory(f"KV: hot · {saved_phrase(report)}", "hot")
        if report.snapshot.error:
            self.ctx.app.notify(report.snapshot.error, severity="warning", markup=False)
        if self.tool_steps:  # the calls and their results are messages too: show them
            self.tool_steps = 0
            await self.opener.show_latest(lazy=True)
        self.ctx.post(SessionsChanged())
        self.ctx.post(TurnEnded())  # the settle and the snapshot write run, unless a message waits

    async def switch_version(self, view: MessageView, step: int) -> None:
        """←/→ on the last reply: make its previous / next version current and show it."""
        if not idle_or_say(self.ctx.app, self.ctx.state, "switch a reply's version"):
            return
        views = self.ctx.conversation.views
        if view.message_id is None or not views or view is not views[-1]:
            self.ctx.app.notify(
                "Only the last reply has versions to switch (Ctrl+R makes a new one)"
            )
            return
        try:
            # On the engine thread: it takes the session's turn lock, like a turn.
            message = await self.ctx.backend.on_engine(
                self.ctx.backend.chat.sessions.switch_version, view.message_id, step
            )
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="warning", markup=False)
            return
        if message is None:
            edge = "first" if step < 0 else "last"
            self.ctx.app.notify(f"This is the {edge} version of the reply (Ctrl+R makes a new one)")
            return
        position, count = await self.ctx.backend.on_store(
            self.ctx.backend.chat.sessions.reply_versions, message.id
        )
        figures = self.ctx.conversation.thought_figures.get((message.id, message.reasoning))
        await view.show_version(message, position, count, figures)
        self.ctx.status.set_turn(
            f"reply version {position} of {count}: the next message reuses the KV up to it"
        )
        self.ctx.post(SessionsChanged())

    def cancel(self) -> bool:
        """Esc: stop the reply (the engine thread sees the flag between tokens); whether
        there was one to stop."""
        turn = self.ctx.state.turn
        if turn is None or turn.cancel.is_set():
            return False
        turn.cancel.set()
        self.ctx.status.set_turn("stopping…", "busy")
        return True


def _splitter(style: Any, turn: ActiveTurn) -> Any:
    """On the engine thread: the turn's splitter for the model's reasoning ``style``; a
    continued reply's is fed the reply as written so far first (as the service continues
    it: a reply cut while reasoning goes on inside its think block)."""
    from kvchat.service.reasoning import ReasoningStream, as_written

    splitter = ReasoningStream(style)
    if turn.kind == "continue" and style.thinks:
        reasoning, answer = turn.before_reasoning, turn.before
        splitter.feed(as_written(reasoning, answer, style))
        turn.answer_seen = bool(answer) or not reasoning
    return splitter


def _thinking(turn: ActiveTurn) -> bool:
    """Whether the model reasons now: a thinking model with no answer yet, past the first
    piece (or whose reply starts inside its think block)."""
    splitter = turn.splitter
    if splitter is None or not splitter.style.thinks or turn.answer_seen:
        return False
    return splitter.style.opens_inside or bool(splitter.text.strip())


def _figures(turn: ActiveTurn) -> ThoughtFigures:
    seconds = turn.thought_seconds
    if seconds is None and turn.thought_started is not None and not _thinking(turn):
        seconds = time.perf_counter() - turn.thought_started
    return ThoughtFigures(turn.thought_tokens, seconds)


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says the user's message was not sent (it goes back to the input)."""
    from kvchat.service.reports import MessageRefused  # the service is loaded: no import cost

    return isinstance(exc, MessageRefused)


# The live rate waits this long after the first piece (before it, one flush's pieces over
# a few milliseconds would read as thousands of tokens a second).
LIVE_RATE_AFTER_S = 0.5


def live_rate(turn: ActiveTurn, now: float | None = None) -> str:
    """`` · 31 tok/s``: the pieces drawn since the first over the time since then (what the
    user sees the model do now); "" until :data:`LIVE_RATE_AFTER_S` has passed."""
    if turn.first_drawn is None:
        return ""
    since, at_first = turn.first_drawn
    seconds = (time.perf_counter() if now is None else now) - since
    if seconds < LIVE_RATE_AFTER_S:
        return ""
    return f" · {(turn.pieces - at_first) / seconds:,.0f} tok/s"
