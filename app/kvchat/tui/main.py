"""The main screen: sessions, conversation, input and status, wired to ChatService.

Every call that touches the model goes to the app's engine thread; store reads and
store-only writes go to its store thread. The UI thread only awaits their results.
What the screen does lives in its mixins, one concern each: opening sessions
(``opening``), turns (``replies``), the watch on other processes (``watch``), session,
branch and message actions. Textual collects ``@on`` handlers from the screen class only,
so they are all here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual import events, on
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
from kvchat.tui.keys import bindings
from kvchat.tui.messages import MessageActions
from kvchat.tui.model_actions import ModelActions
from kvchat.tui.opening import LOADING_PLACEHOLDER, SessionOpening
from kvchat.tui.replies import FLUSH_HZ, ActiveTurn, TurnActions
from kvchat.tui.watch import SessionWatch
from kvchat.tui.widgets.conversation import Conversation, MessageView
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.sidebar import SessionItem, SessionList
from kvchat.tui.widgets.status import StatusBar

if TYPE_CHECKING:
    from textual.binding import BindingType

    # Imported lazily at run time: kvchat.service.chat pulls in llama.cpp, which is not needed to
    # paint the first screen (it is imported on the engine thread while the model loads).
    from kvchat.service.chat import RestoreResult, TurnReport

__all__ = ["ActiveTurn", "MainScreen"]

# Below this many columns the sessions sidebar hides itself (Ctrl+L shows it).
NARROW_COLUMNS = 80


class MainScreen(
    ModelActions,  # before SessionOpening: it adds to _make_hot (see model_actions)
    SessionOpening,
    TurnActions,
    SessionWatch,
    SessionActions,
    BranchActions,
    MessageActions,
    Screen[None],
):
    """Sessions sidebar, conversation, input and status bar; every key of the key table."""

    BINDINGS: ClassVar[list[BindingType]] = [*bindings()]

    def __init__(self) -> None:
        super().__init__(id="main-screen")
        self.session_id: str | None = None
        # What the UI has finished doing for a session: shown its messages / made it hot.
        # An interrupted switch leaves these behind, so the next one redoes the work.
        self._shown_id: str | None = None
        self._hot_id: str | None = None
        # The open session and when it last changed, as shown (see SessionWatch).
        self.seen_change: tuple[str, str] | None = None
        self.ready = False
        self.turn: ActiveTurn | None = None
        self.last_turn: ActiveTurn | None = None
        self.last_report: TurnReport | None = None
        self.last_restore: RestoreResult | None = None
        self.last_switch_ms: float | None = None
        self.last_jump_ms: float | None = None
        self.turn_figures: dict[int, TurnReport] = {}
        # Sessions this run made (Ctrl+N, a first message): those left empty go at quit.
        self.made_sessions: set[str] = set()
        self._flusher: Timer | None = None
        # Engine-thread work: user actions queued / in flight, and housekeeping running.
        self._engine_actions = 0
        self._engine_jobs = 0
        self._housekeeping = False
        # The sidebar as the user set it with Ctrl+L; None: by the width (see NARROW_COLUMNS).
        self.sidebar_wanted: bool | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield SessionList(id="sessions")
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield PromptInput(
                    id="prompt",
                    takes_sent=True,
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
        self.start_watch()
        # After the first frame: opening the service imports llama.cpp (on the engine
        # thread, but an import holds the interpreter's lock in long stretches).
        self.call_after_refresh(self.startup)

    # --- events of the widgets --------------------------------------------------------------

    @on(SessionList.Selected)
    def _session_selected(self, event: SessionList.Selected) -> None:
        if isinstance(event.item, SessionItem):
            self.open_session(event.item.session_id, focus_prompt=True)
            if self.size.width < NARROW_COLUMNS:
                self.sidebar_wanted = None  # picked: a narrow window gives the chat room back
                self._show_sidebar()

    def on_resize(self, event: events.Resize) -> None:
        self._show_sidebar()
        self.set_class(event.size.width < NARROW_COLUMNS, "-narrow")  # see kvchat.tcss
        # A narrow footer: the palette's key, docked right, would overlap the others.
        footer = self.query_one(Footer)
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

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        self.submit(event.text)

    @on(MessageView.CopyRequested)
    def _copy_requested(self, event: MessageView.CopyRequested) -> None:
        if event.code:
            self.action_copy_code(event.view)
        elif event.view.text:
            self._copy(event.view.text, "message")

    @on(MessageView.VersionRequested)
    def _version_requested(self, event: MessageView.VersionRequested) -> None:
        self.switch_version(event.view, event.step)

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

    def action_help(self) -> None:
        from kvchat.tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen())
