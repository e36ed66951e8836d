"""The main screen: sessions, conversation, input and status, wired to ChatService.

Every call that touches the model goes to the app's engine thread; store reads and
store-only writes go to its store thread. The UI thread only awaits their results.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from kvchat.errors import KvchatError
from kvchat.tui.actions import SessionActions
from kvchat.tui.branches import BranchActions
from kvchat.tui.format import restore_phrase, saved_phrase
from kvchat.tui.keys import bindings
from kvchat.tui.messages import MessageActions
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.widgets.conversation import Conversation, MessageView
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.sidebar import SessionItem, SessionList, SessionRow
from kvchat.tui.widgets.status import StatusBar

if TYPE_CHECKING:
    from textual.binding import BindingType

    # Imported lazily at run time: app.chat pulls in llama.cpp, which is not needed to
    # paint the first screen (it is imported on the engine thread while the model loads).
    from kvchat.chat import Message, RestoreResult, TurnReport
    from kvchat.tui.app import KvchatApp

# Streamed tokens are buffered by the engine thread and drawn this often.
FLUSH_HZ = 25
READY_PLACEHOLDER = "Message (Enter sends · Ctrl+J new line · F1 keys)"
LOADING_PLACEHOLDER = "Loading the model… (you can type already)"


@dataclass
class ActiveTurn:
    """A reply being generated: the engine thread appends to ``sink``; the UI drains it."""

    kind: str  # "send" or "regenerate"
    session_id: str | None
    text: str | None
    cancel: threading.Event = field(default_factory=threading.Event)
    sink: deque[str] = field(default_factory=deque)
    view: MessageView | None = None
    pieces: int = 0
    started: float = field(default_factory=time.perf_counter)


class MainScreen(SessionActions, BranchActions, MessageActions, Screen[None]):
    """Sessions sidebar, conversation, input and status bar; every key of the key table."""

    BINDINGS: ClassVar[list[BindingType]] = [*bindings()]

    def __init__(self) -> None:
        super().__init__(id="main-screen")
        self.session_id: str | None = None
        # What the UI has finished doing for a session: shown its messages / made it hot.
        # An interrupted switch leaves these behind, so the next one redoes the work.
        self._shown_id: str | None = None
        self._hot_id: str | None = None
        self.ready = False
        self.turn: ActiveTurn | None = None
        self.last_turn: ActiveTurn | None = None
        self.last_report: TurnReport | None = None
        self.last_restore: RestoreResult | None = None
        self.last_switch_ms: float | None = None
        self.last_jump_ms: float | None = None
        self.turn_figures: dict[int, TurnReport] = {}
        self._flusher: Timer | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield SessionList(id="sessions")
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield PromptInput(
                    id="prompt",
                    placeholder=LOADING_PLACEHOLDER,
                    soft_wrap=True,
                    show_line_numbers=False,
                    tab_behavior="focus",
                )
        yield StatusBar(id="status")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.prompt.focus()
        self.prompt.cursor_blink = self.kv_app.cursor_blink
        self.status.set_turn("starting…", "busy")
        self._flusher = self.set_interval(1 / FLUSH_HZ, self._flush, pause=True)
        self.startup()

    # --- start ----------------------------------------------------------------------------

    @work(group="startup", exit_on_error=False)
    async def startup(self) -> None:
        app = self.kv_app
        if app.service is None:
            try:
                await self.on_engine(_open_service, app)
            except KvchatError as exc:
                app.show_fatal("kvchat cannot open its data", str(exc))
                return
        service = self.service
        last = await self.on_store(service.last_session)
        if last is not None:
            self.session_id = last.id
            await self.conversation.show(await self.on_store(service.messages, last.id))
            self._shown_id = last.id
        else:
            await self.conversation.show([])
        await self.refresh_sessions()
        self.status.set_turn(f"loading model {app.model_label}…", "busy")
        try:
            name, n_ctx, note = await self.on_engine(self._engine_load)
        except KvchatError as exc:
            app.show_model_error(exc)
            return
        self.ready = True
        self.status.set_model(name, n_ctx)
        self.status.set_context(0)
        self.prompt.placeholder = READY_PLACEHOLDER
        self.status.set_turn(f"ready · {note}" if note else "ready")
        app.ready_at = time.perf_counter()
        if self.session_id is not None:
            await self._make_hot(self.session_id)

    def _engine_load(self) -> tuple[str, int, str | None]:
        engine = self.service.load_engine()
        return engine.config.model_path.stem, engine.n_ctx, self.service.plan_note

    # --- sessions -------------------------------------------------------------------------

    async def refresh_sessions(self) -> None:
        rows = await self.on_store(self._session_rows)
        await self.sessions.show(self._with_context(rows), self.session_id)

    def _with_context(self, rows: list[SessionRow]) -> list[SessionRow]:
        """The open session's row with the context gauge's figure: one number for both."""
        if self._hot_id is None or self._hot_id != self.session_id:
            return rows
        used = self.status.used
        return [replace(r, context=used) if r.id == self._hot_id else r for r in rows]

    def _session_rows(self) -> list[SessionRow]:
        service = self.service
        return [SessionRow(s, service.kv_location(s.session.id)) for s in service.list_sessions()]

    @work(group="sidebar", exclusive=True, exit_on_error=False)
    async def request_refresh(self) -> None:
        await self.refresh_sessions()

    def _engine_make_hot(self, session_id: str) -> tuple[RestoreResult, int]:
        """On the engine thread: make the session hot (a new branch borrows its shared
        prefix from another session's snapshot) and report the context's size."""
        result = self.service.make_hot(session_id)
        return result, self.service.context_tokens

    async def _make_hot(self, session_id: str) -> None:
        """Bring the open session's KV into the context and show where it came from."""
        started = time.perf_counter()
        self.status.set_memory("KV: restoring…", "busy")
        result, used = await self.on_engine(self._engine_make_hot, session_id)
        if session_id != self.session_id:
            return
        self._hot_id = session_id
        self.last_switch_ms = (time.perf_counter() - started) * 1000
        self.last_restore = result
        self.status.set_memory(f"KV: {restore_phrase(result)}", result.source)
        self.status.set_context(used if result.source != "none" else 0)
        self.request_refresh()

    @on(SessionList.Selected)
    def _session_selected(self, event: SessionList.Selected) -> None:
        if isinstance(event.item, SessionItem):
            self.open_session(event.item.session_id, focus_prompt=True)

    @work(group="open", exclusive=True, exit_on_error=False)
    async def open_session(
        self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
    ) -> None:
        """Show a session's messages, then make it hot on the engine thread."""
        if self.turn is not None and session_id != self.session_id:
            self.notify("A reply is being generated: Esc stops it", severity="warning")
            self.sessions.highlight(self.session_id)
            return
        if session_id != self.session_id:
            self.status.set_turn("")
        self.session_id = session_id
        self.sessions.highlight(session_id)
        started = time.perf_counter()
        shown = session_id == self._shown_id
        if not shown or (highlight is not None and self.conversation.find(highlight) is None):
            self._shown_id = None
            messages: list[Message] = await self.on_store(self.service.messages, session_id)
            # One batch for the new messages and the scroll to the hit: no frame between.
            with self.app.batch_update():
                await self.conversation.show(messages, around=highlight)
                if highlight is not None:
                    self._jump_to(highlight)
            self._shown_id = session_id
        elif highlight is not None:
            self._jump_to(highlight)
        if highlight is not None:
            self.last_jump_ms = (time.perf_counter() - started) * 1000
        elif focus_prompt:
            self.prompt.focus()
        if self.ready and session_id != self._hot_id:
            await self._make_hot(session_id)

    async def show_latest(self, focus_last: bool = False) -> None:
        """Show the session's latest messages again (after a jump left them out)."""
        if self.session_id is None:
            return
        messages = await self.on_store(self.service.messages, self.session_id)
        await self.conversation.show(messages)
        last = self.conversation.last_view
        if focus_last and last is not None:
            last.focus()

    def _jump_to(self, message_id: int) -> None:
        view = self.conversation.find(message_id)
        if view is None:
            return
        # Anchoring keeps a short conversation at the bottom with a negative scroll offset;
        # drop both before scrolling to the hit.
        self.conversation.anchor(False)
        self.conversation.scroll_to(y=0, animate=False, force=True, immediate=True)
        self.conversation.scroll_to_widget(view, animate=False, top=True, immediate=True)
        self.set_focus(view, scroll_visible=False)  # now, not after a refresh: one frame
        view.add_class("-hit")
        self.set_timer(4, lambda: view.remove_class("-hit"))

    async def _new_session_id(self) -> str:
        session = await self.on_store(self.service.new_session)
        return str(session.id)

    # --- turns ----------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if not self.ready:
            self.notify("The model is still loading; your message is kept", severity="warning")
            return
        if self.turn is not None:
            self.notify("Wait for the reply, or press Esc to stop it", severity="warning")
            return
        self.prompt.clear()
        self.turn = ActiveTurn("send", self.session_id, text)
        self.run_turn(self.turn)

    def action_regenerate(self) -> None:
        if not self.ready or self.turn is not None:
            self.notify("Wait for the model to be ready and idle", severity="warning")
            return
        views = self.conversation.views
        if self.session_id is None or not views:
            self.notify("Nothing to regenerate yet", severity="warning")
            return
        self.turn = ActiveTurn("regenerate", self.session_id, None)
        self.run_turn(self.turn)

    @work(group="turn", exit_on_error=False)
    async def run_turn(self, turn: ActiveTurn) -> None:
        conversation = self.conversation
        try:
            if turn.session_id is None:
                turn.session_id = self.session_id = await self._new_session_id()
                self._shown_id = turn.session_id
                self.request_refresh()
            if conversation.later:  # a jump left the latest messages out: back to them
                await self.show_latest()
            if turn.kind == "send":
                assert turn.text is not None
                await conversation.add(MessageView("user", turn.text))
            else:
                views = conversation.views
                if views and views[-1].role == "assistant":
                    await views[-1].remove()
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
            self.status.set_turn(str(exc) or type(exc).__name__, "error")
            if turn.view is not None and turn.view.stream is not None:
                await turn.view.stream.stop()
            if turn.session_id is not None and turn.session_id == self.session_id:
                await conversation.show(await self.on_store(self.service.messages, turn.session_id))
            self.request_refresh()
            if not isinstance(exc, KvchatError):
                raise  # a bug: the worker-error handler reports it
            self.notify(str(exc), severity="error", markup=False)
            return
        self.turn = None
        self.last_turn = turn
        await self._finish_turn(turn, report, used)

    def _engine_turn(self, turn: ActiveTurn) -> tuple[TurnReport, int]:
        service = self.service
        assert turn.session_id is not None
        if turn.kind == "send":
            assert turn.text is not None
            report = service.send(
                turn.session_id, turn.text, on_token=turn.sink.append, cancel=turn.cancel.is_set
            )
        else:
            report = service.regenerate(
                turn.session_id, on_token=turn.sink.append, cancel=turn.cancel.is_set
            )
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
        if report.message_id is None:
            await view.finish(text="", message_id=None, partial=True)
            await view.remove()
            if report.finish_reason == "cancelled":
                self.notify("Stopped before the first token: no reply to keep")
        else:
            self.turn_figures[report.message_id] = report
            await view.finish(
                text=report.reply, message_id=report.message_id, partial=report.partial
            )
        self.status.set_turn(report.summary(), "warning" if report.partial else "")
        self.status.set_context(used)
        restore = report.restore
        if restore.source in ("disk", "ram"):
            self.last_restore = restore
            self.status.set_memory(f"KV: {restore_phrase(restore)}", restore.source)
        elif restore.source == "none" or not (
            self.last_restore is not None and self.last_restore.source in ("disk", "ram")
        ):
            # Keep showing how the session came back (after a restore); else what was saved.
            self.last_restore = restore
            self.status.set_memory(f"KV: hot · {saved_phrase(report)}", "hot")
        if report.snapshot.error:
            self.notify(report.snapshot.error, severity="warning", markup=False)
        self.request_refresh()

    def action_cancel(self) -> None:
        """Esc: stop the reply; the engine thread sees the flag between tokens."""
        if self.turn is not None and not self.turn.cancel.is_set():
            self.turn.cancel.set()
            self.status.set_turn("stopping…", "busy")
        elif self.focused is not self.prompt:
            self.prompt.focus()

    @on(MessageView.CopyRequested)
    def _copy_requested(self, event: MessageView.CopyRequested) -> None:
        if event.code:
            self.action_copy_code(event.view)
        elif event.view.text:
            self._copy(event.view.text, "message")

    @on(MessageView.DetailsRequested)
    def _details_requested(self, event: MessageView.DetailsRequested) -> None:
        self.action_message_details(event.view)

    @on(Conversation.LatestRequested)
    async def _latest_requested(self) -> None:
        await self.show_latest(focus_last=True)

    @on(Conversation.LeaveRequested)
    def _leave_requested(self) -> None:
        self.prompt.focus()

    @on(MessageView.BranchRequested)
    def _branch_requested(self, event: MessageView.BranchRequested) -> None:
        self.action_branch(event.view)

    @on(MessageView.EditRequested)
    def _edit_requested(self, event: MessageView.EditRequested) -> None:
        self.action_edit_message(event.view)

    @on(MessageView.TypedAhead)
    def _typed_ahead(self, event: MessageView.TypedAhead) -> None:
        self.prompt.focus()
        self.prompt.insert(event.character)

    @on(Worker.StateChanged)
    def _worker_changed(self, event: Worker.StateChanged) -> None:
        """One place for failures of background work: a notice, never a crash."""
        if event.state != WorkerState.ERROR or self.kv_app.closing:
            return
        error = event.worker.error
        assert error is not None
        self.kv_app.worker_errors.append(error)
        if isinstance(error, KvchatError):
            self.notify(str(error), severity="error", markup=False)
        else:
            self.log.error(f"{event.worker.name} failed", error)
            self.notify(
                f"Unexpected error in {event.worker.name}: {error!r}",
                title="kvchat bug",
                severity="error",
                markup=False,
                timeout=15,
            )

    # --- other ----------------------------------------------------------------------------

    @property
    def focus_chain(self) -> list[Widget]:
        """Tab stops: the messages count as one (see Conversation.tab_stop); ↑/↓ move in them."""
        chain = super().focus_chain
        try:
            stop = self.conversation.tab_stop()
        except NoMatches:  # not composed yet, or being torn down
            return chain
        return [w for w in chain if not isinstance(w, MessageView) or w is stop]

    def action_focus_sessions(self) -> None:
        self.sessions.focus()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())


def _open_service(app: KvchatApp) -> None:
    """Runs on the engine thread: importing app.chat loads llama.cpp's bindings.

    Set here, not by the awaiting worker, so a quit during start still closes it.
    """
    from kvchat.chat import ChatService

    app.service = ChatService(app.settings)
