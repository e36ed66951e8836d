"""The main screen: sessions, conversation, input and status, wired to the service.

The screen composes the widgets and hands them, with the shared ``ScreenState`` and the
app's ``Backend``, to collaborators that each own one concern: opening sessions
(``opener``), turns (``turns``), housekeeping after a reply (``idle_work``), the watch on
other processes (``watch``), session, branch, message and model actions. The widgets
report what the user did with typed Messages (``MessageView.VersionRequested``…), the
collaborators what they need done with those of ``signals``; the screen handles each in
one place below. Each collaborator is given one ``ScreenContext`` (the app, the backend,
the state, the widgets, and the screen's ``post``, ``refresh`` and ``run``), not the same
seven to nine parameters each. Every background job is a worker of the screen, started by
MainScreen.run_job as its ``context.Job`` says (group, exclusivity), so one handler
reports failures; the key table's actions are the ``action_*`` workers Textual's bindings
call, each one collaborator's job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, ParamSpec, TypeVar

from textual import events, on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.worker import Worker, WorkerState

from kvchat.errors import KvchatError
from kvchat.tui.backend import Backend
from kvchat.tui.keys import bindings
from kvchat.tui.main.attachments import Attachments
from kvchat.tui.main.branching import Branching
from kvchat.tui.main.compaction import Compacting
from kvchat.tui.main.context import (
    COUNT_TOKENS,
    DOCUMENTS,
    LATEST,
    MORE_SESSIONS,
    OPEN_SESSION,
    PICK_MODEL,
    REFRESH_SESSIONS,
    SESSION_MODEL,
    STARTUP,
    SWITCH_VERSION,
    WATCH,
    Job,
    ScreenContext,
)
from kvchat.tui.main.idle_work import IdleWork
from kvchat.tui.main.message_actions import MessageActions
from kvchat.tui.main.model_switch import ModelSwitch
from kvchat.tui.main.opener import LOADING_PLACEHOLDER, SessionOpener
from kvchat.tui.main.screen_state import ActiveTurn, ScreenState, ready_or_say
from kvchat.tui.main.session_actions import SessionActions
from kvchat.tui.main.session_feed import SessionFeed
from kvchat.tui.main.signals import (
    DocumentsChanged,
    OpenRequested,
    SendRequested,
    SessionHot,
    SessionsChanged,
    TurnEnded,
    TurnRequested,
)
from kvchat.tui.main.slash import SlashCommands
from kvchat.tui.main.tools import ToolCalls
from kvchat.tui.main.turns import FLUSH_HZ, TurnRunner
from kvchat.tui.main.watch import WATCH_S, SessionWatch
from kvchat.tui.stacked import RepaintsScreensAbove
from kvchat.tui.widgets.conversation import Conversation, MessageView
from kvchat.tui.widgets.documents import DocumentsPanel
from kvchat.tui.widgets.footer import KeysFooter
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.sidebar import SessionList
from kvchat.tui.widgets.status import StatusBar

if TYPE_CHECKING:
    from textual.binding import BindingType

    from kvchat.service.chat import RestoreResult, TurnReport

P = ParamSpec("P")
T = TypeVar("T")

# Below this many columns the sessions sidebar hides itself (Ctrl+L shows it).
NARROW_COLUMNS = 80
# An Esc this soon after a dialog closed was meant for the dialog (a user pressing Esc
# through a few of them): it does not stop the reply.
ESC_AFTER_DIALOG_S = 1.0


class MainScreen(RepaintsScreensAbove):
    """Sessions sidebar, conversation, input and status bar; every key of the key table.
    What changes under a stack of dialogs is drawn through them (see kvchat.tui.stacked)."""

    BINDINGS: ClassVar[list[BindingType]] = [*bindings()]

    def __init__(self, backend: Backend, *, cursor_blink: bool = True) -> None:
        super().__init__(id="main-screen")
        self.backend = backend
        self.state = ScreenState()
        # The sidebar as the user set it with Ctrl+L; None: by the width (see NARROW_COLUMNS).
        self.sidebar_wanted: bool | None = None
        self._resumed_at = 0.0  # when a dialog on top of this screen last closed
        self._esc_said = False  # the Esc after it was told it stops nothing
        self.sessions = SessionList(id="sessions")
        self.conversation = Conversation(id="conversation")
        self.prompt = PromptInput(
            id="prompt",
            takes_sent=True,
            placeholder=LOADING_PLACEHOLDER,
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
        )
        self.prompt.cursor_blink = cursor_blink
        self.status = StatusBar(id="status")
        self.documents = DocumentsPanel(id="documents")
        self.slash = SlashCommands()
        self.slash.on_help(lambda text: self.app.notify(text, title="Commands", timeout=12))
        ctx = ScreenContext(
            app=self.app,
            backend=backend,
            state=self.state,
            conversation=self.conversation,
            sessions=self.sessions,
            status=self.status,
            prompt=self.prompt,
            documents=self.documents,
            slash=self.slash,
            post=self.post_message,
            refresh=self.refresh_sessions,
            run=self.run_job,
        )
        self.feed = SessionFeed(ctx)
        self.opener = SessionOpener(ctx)
        self.idle_work = IdleWork(ctx)
        self.turns = TurnRunner(ctx, opener=self.opener, idle_work=self.idle_work)
        self.session_watch = SessionWatch(ctx, opener=self.opener)
        self.session_actions = SessionActions(ctx, opener=self.opener)
        self.branching = Branching(ctx, opener=self.opener)
        self.message_actions = MessageActions(ctx, opener=self.opener)
        self.model_switch = ModelSwitch(ctx, opener=self.opener)
        self.attachments = Attachments(ctx, opener=self.opener)
        self.tool_calls = ToolCalls(ctx, opener=self.opener)
        self.turns.tool_approver = self.tool_calls.approver()
        self.compacting = Compacting(ctx, opener=self.opener)
        self.turns.on_view = self.compacting.show_view

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield self.sessions
            with Vertical(id="chat"):
                yield self.conversation
                yield self.documents
                yield self.prompt
        yield self.status
        yield KeysFooter(compact=True)

    def on_mount(self) -> None:
        self.prompt.focus()
        self.status.set_turn("starting…", "busy")
        self.turns.flusher = self.set_interval(1 / FLUSH_HZ, self.turns.flush, pause=True)
        self.set_interval(WATCH_S, self._watch_tick)
        # After the first frame: opening the service imports llama.cpp (on the engine
        # thread, but an import holds the interpreter's lock in long stretches).
        self.call_after_refresh(self.run_job, STARTUP, self.opener.start)

    # --- what tests, the benchmark and the app read ----------------------------------------

    @property
    def session_id(self) -> str | None:
        return self.state.session_id

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def turn(self) -> ActiveTurn | None:
        return self.state.turn

    @property
    def last_turn(self) -> ActiveTurn | None:
        return self.state.last_turn

    @property
    def last_report(self) -> TurnReport | None:
        return self.state.last_report

    @property
    def last_restore(self) -> RestoreResult | None:
        return self.state.last_restore

    @property
    def last_jump_ms(self) -> float | None:
        return self.state.last_jump_ms

    @property
    def hot_id(self) -> str | None:
        return self.state.hot_id

    @property
    def shown_id(self) -> str | None:
        return self.state.shown_id

    @property
    def made_sessions(self) -> set[str]:
        return self.state.made_sessions

    @property
    def turn_figures(self) -> dict[int, TurnReport]:
        return self.state.turn_figures

    @property
    def housekeeping_idle(self) -> bool:
        """No housekeeping runs here, and the last turn left none pending."""
        return self.idle_work.idle

    # --- workers: how each kind of work runs -------------------------------------------------

    def run_job(
        self,
        job: Job,
        work: Callable[P, Coroutine[Any, Any, T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Worker[T]:
        """Start ``work(*args, **kwargs)`` as a worker of this screen, in ``job``'s group
        (cancelling the one running there when ``job`` is exclusive); as ``@work`` does."""
        return self.run_worker(
            partial(work, *args, **kwargs),
            name=job.name,
            group=job.group,
            exclusive=job.exclusive,
            exit_on_error=False,
        )

    def open_session(
        self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
    ) -> None:
        """Show a session's messages, then make it hot on the engine thread."""
        self.run_job(OPEN_SESSION, self.opener.open, session_id, highlight, focus_prompt)

    async def refresh_sessions(self) -> None:
        """Show what changed in the sessions list (see SessionFeed); the first time, its
        first page, then the others in the background."""
        await self.feed.refresh()
        if not self.feed.complete:
            self.run_job(MORE_SESSIONS, self.feed.load_rest)

    def _watch_tick(self) -> None:
        if self.state.ready and self.state.turn is None:
            # Housekeeping a user's action made yield (and no turn dropped) runs again.
            self.idle_work.start()
            self.run_job(WATCH, self.check_for_changes)

    async def check_for_changes(self) -> None:
        """What other processes did: one row read (the list's change stamp) while nothing
        changed; else the changes, and the open session again if it is among them."""
        await self.feed.poll()
        if self.feed.take_touched(self.state.session_id) and self.session_watch.due:
            await self.session_watch.check()

    @on(Worker.StateChanged)
    def _worker_changed(self, event: Worker.StateChanged) -> None:
        """One place for failures of background work: a notice, never a crash."""
        if event.state == WorkerState.ERROR:
            self._worker_failed(event.worker)

    @on(Conversation.PagingFailed)
    def _paging_failed(self, event: Conversation.PagingFailed) -> None:
        self._worker_failed(event.worker)

    def _worker_failed(self, worker: Worker[Any]) -> None:
        if self.backend.closing:
            return
        error = worker.error
        assert error is not None
        self.backend.worker_errors.append(error)
        if isinstance(error, KvchatError):
            self.notify(str(error), severity="error", markup=False)
        else:
            self.log.error(f"{worker.name} failed", error)
            self.notify(
                f"Unexpected error in {worker.name}: {error!r}",
                title="kvchat bug",
                severity="error",
                markup=False,
                timeout=15,
            )

    # --- what the collaborators ask for ---------------------------------------------------

    @on(SessionsChanged)
    def _sessions_changed(self) -> None:
        self.run_job(REFRESH_SESSIONS, self.refresh_sessions)

    @on(OpenRequested)
    def _open_requested(self, event: OpenRequested) -> None:
        self.open_session(event.session_id, event.highlight, event.focus_prompt)

    @on(SessionHot)
    def _session_hot(self, event: SessionHot) -> None:
        self.run_job(SESSION_MODEL, self.model_switch.note_session_model, event.session_id)
        self.run_job(COUNT_TOKENS, self.session_actions.count_tokens, event.session_id)
        self.run_job(DOCUMENTS, self.attachments.show_session)
        self.compacting.refresh_view(event.session_id)

    @on(TurnRequested)
    def _turn_requested(self, event: TurnRequested) -> None:
        self.turns.start(event.turn)

    @on(TurnEnded)
    def _turn_ended(self) -> None:
        self.idle_work.start()
        self.run_job(DOCUMENTS, self.attachments.show_session)

    @on(DocumentsChanged)
    def _documents_changed(self) -> None:
        self.run_job(DOCUMENTS, self.attachments.show_session)

    @on(SendRequested)
    def _send_requested(self, event: SendRequested) -> None:
        self.turns.start(self.turns.submit(event.text))

    @on(DocumentsPanel.Removed)
    def _document_removed(self, event: DocumentsPanel.Removed) -> None:
        self.attachments.remove(event.index)

    # --- what the widgets report ----------------------------------------------------------

    @on(SessionList.Picked)
    def _session_picked(self, event: SessionList.Picked) -> None:
        self.open_session(event.session_id, focus_prompt=True)
        if self.size.width < NARROW_COLUMNS:
            self.sidebar_wanted = None  # picked: a narrow window gives the chat room back
            self._show_sidebar()

    @on(PromptInput.Changed, "#prompt")
    def _typed(self) -> None:
        self.opener.drafts.changed()

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        if event.prompt is self.prompt:
            self.opener.drafts.sent()
        dispatched = self.slash.dispatch(event.text)
        if dispatched.ran:
            return
        # A message naming files or folders waits while the user says whether to attach.
        if not self.attachments.offer(dispatched.text):
            self.turns.start(self.turns.submit(dispatched.text))

    @on(PromptInput.Pasted)
    def _pasted(self, event: PromptInput.Pasted) -> None:
        self.attachments.pasted(event.text)

    @on(MessageView.VersionRequested)
    def _version_requested(self, event: MessageView.VersionRequested) -> None:
        self.run_job(SWITCH_VERSION, self.turns.switch_version, event.view, event.step)

    @on(Conversation.LatestRequested)
    def _latest_requested(self) -> None:
        """End, or ↓ past the last message shown: the latest messages, the last focused."""
        self.run_job(LATEST, self.opener.show_latest, focus_last=True, lazy=True)

    @on(Conversation.LeaveRequested)
    def _leave_requested(self) -> None:
        self.prompt.focus()

    @on(MessageView.TypedAhead)
    @on(SessionList.TypedAhead)
    def _typed_ahead(self, event: MessageView.TypedAhead | SessionList.TypedAhead) -> None:
        self.prompt.focus()
        self.prompt.insert(event.character)

    def on_resize(self, event: events.Resize) -> None:
        self._show_sidebar()
        self.set_class(event.size.width < NARROW_COLUMNS, "-narrow")  # see kvchat.tcss
        # A narrow footer: the palette's key, docked right, would overlap the others.
        footer = self.query_one(KeysFooter)
        wide = event.size.width >= NARROW_COLUMNS
        if footer.show_command_palette != wide:
            footer.show_command_palette = wide
            footer.refresh(recompose=True)  # the footer builds its keys when composed

    def _show_sidebar(self) -> None:
        """Show or hide the sessions sidebar: as set by Ctrl+L, else by the width."""
        wanted = self.sidebar_wanted
        shown = wanted if wanted is not None else self.size.width >= NARROW_COLUMNS
        sessions = self.sessions
        if sessions.display != shown:
            sessions.display = shown
            if not shown and self.focused is sessions:
                self.prompt.focus()

    @property
    def focus_chain(self) -> list[Widget]:
        """Tab stops: the messages count as one (see Conversation.tab_stop); ↑/↓ move in them."""
        chain = super().focus_chain
        try:
            stop = self.conversation.tab_stop()
        except NoMatches:  # not composed yet, or being torn down
            return chain
        return [w for w in chain if not isinstance(w, MessageView) or w is stop]

    # --- the key table's actions ----------------------------------------------------------

    def on_screen_resume(self) -> None:
        self._resumed_at = time.monotonic()  # a dialog on top just closed
        self._esc_said = False

    def action_cancel(self) -> None:
        """Esc: stop the reply; else back to the input. Within ESC_AFTER_DIALOG_S of a
        dialog closing, an Esc is one more meant for dialogs: it stops nothing (said once)."""
        if self.turn is not None and time.monotonic() - self._resumed_at < ESC_AFTER_DIALOG_S:
            if not self._esc_said:
                self._esc_said = True
                self.notify("The dialog is closed; Esc in a moment stops the reply", timeout=3)
            return
        if not self.turns.cancel() and self.focused is not self.prompt:
            self.prompt.focus()

    def action_regenerate(self) -> None:
        self.turns.start(self.turns.regenerate())

    def action_continue_reply(self) -> None:
        """F12: go on with the last reply (one cut at the token limit) from the hot KV."""
        self.turns.start(self.turns.continue_reply())

    @work(group="action", exit_on_error=False)
    async def action_new_session(self) -> None:
        await self.session_actions.new_session()

    @work(group="action", exit_on_error=False)
    async def action_rename(self) -> None:
        await self.session_actions.rename()

    @work(group="action", exit_on_error=False)
    async def action_delete(self) -> None:
        await self.session_actions.delete()

    @work(group="action", exit_on_error=False)
    async def action_search(self) -> None:
        await self.session_actions.search()

    @work(group="action", exit_on_error=False)
    async def action_export(self) -> None:
        await self.session_actions.export()

    @work(group="action", exit_on_error=False)
    async def action_settings(self) -> None:
        await self.session_actions.settings()

    @work(group="action", exit_on_error=False)
    async def action_branch(self, view: MessageView | None = None) -> None:
        await self.branching.branch(view)

    @work(group="action", exit_on_error=False)
    async def action_edit_message(self, view: MessageView | None = None) -> None:
        await self.branching.edit_message(view)

    def action_copy_message(self) -> None:
        self.message_actions.copy_message()

    @work(group="action", exit_on_error=False)
    async def action_copy_code(self, view: MessageView | None = None) -> None:
        await self.message_actions.copy_code(view)

    @work(group="action", exit_on_error=False)
    async def action_message_details(self, view: MessageView | None = None) -> None:
        await self.message_actions.details(view)

    @work(group="action", exit_on_error=False)
    async def action_attach(self) -> None:
        await self.attachments.pick()

    @work(group="action", exit_on_error=False)
    async def action_toggle_thinking(self) -> None:
        await self.session_actions.toggle_thinking()

    def action_pick_model(self) -> None:
        if ready_or_say(self.app, self.state):
            self.run_job(PICK_MODEL, self.model_switch.pick)

    def action_focus_sessions(self) -> None:
        """Ctrl+L: to the sessions list (shown if it was hidden); in the list: hide it."""
        sessions = self.sessions
        if self.focused is sessions:
            self.sidebar_wanted = False
            self._show_sidebar()
            self.prompt.focus()
            return
        if not sessions.display:
            self.sidebar_wanted = True
            self._show_sidebar()
        sessions.focus()

    def action_filter_sessions(self) -> None:
        """Shift+F2: the sessions list (shown if hidden), filtering by title or #tag."""
        if not self.sessions.display:
            self.sidebar_wanted = True
            self._show_sidebar()
        self.sessions.focus()
        self.sessions.action_filter()

    @work(group="action", exit_on_error=False)
    async def action_pin_session(self) -> None:
        await self.session_actions.pin()

    @work(group="action", exit_on_error=False)
    async def action_copy_conversation(self) -> None:
        await self.message_actions.copy_conversation()

    def action_help(self) -> None:
        from kvchat.tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen())
