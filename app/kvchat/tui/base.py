"""The main screen's plumbing, shared by MainScreen and its action mixins.

``ScreenBase`` reaches the app, the service, the two threads and the screen's widgets, and
holds the helpers every group of actions needs. For the type checker it is a Screen that
also declares the state and workers MainScreen defines; at run time it is a plain mixin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat.tui.widgets.conversation import Conversation, MessageView
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.sidebar import SessionList
from kvchat.tui.widgets.status import StatusBar

if TYPE_CHECKING:
    from textual.screen import Screen
    from textual.timer import Timer
    from textual.worker import Worker

    from kvchat.service.chat import ChatService, RestoreResult, TurnReport
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.replies import ActiveTurn
    from kvchat.tui.widgets.sidebar import SessionRow

    _Base = Screen[None]
else:
    _Base = object


class ScreenBase(_Base):
    """Plumbing and shared helpers of the main screen (see the module docstring)."""

    if TYPE_CHECKING:  # defined by MainScreen
        session_id: str | None
        turn: ActiveTurn | None
        ready: bool
        _shown_id: str | None
        _hot_id: str | None
        seen_change: tuple[str, str] | None
        last_turn: ActiveTurn | None
        last_report: TurnReport | None
        last_restore: RestoreResult | None
        last_switch_ms: float | None
        last_jump_ms: float | None
        _flusher: Timer | None
        # The figures of the turns of this run, by the id of the reply each produced.
        turn_figures: dict[int, TurnReport]
        made_sessions: set[str]  # made by this run (see MainScreen)
        # User actions queued on the engine thread so far / not finished yet (housekeeping
        # runs only when none is in flight, and not once a later one was queued).
        _engine_actions: int
        _engine_jobs: int
        _housekeeping: bool  # a housekeep() queued or running on the engine thread

        def start_housekeeping(self) -> None: ...

        async def refresh_sessions(self) -> None: ...
        def request_refresh(self) -> Worker[None]: ...
        async def show_latest(self, focus_last: bool = False) -> None: ...
        async def _show_stored(
            self, session_id: str, highlight: int | None = None, lazy: bool = True
        ) -> None: ...
        async def _flush(self) -> None: ...
        def _session_rows(self) -> list[SessionRow]: ...
        async def _new_session_id(self) -> str: ...
        def open_session(
            self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
        ) -> Worker[None]: ...
        def run_turn(self, turn: ActiveTurn) -> Worker[None]: ...
        async def _stored_id(self, view: MessageView) -> int | None: ...

    @property
    def kv_app(self) -> KvchatApp:
        return self.app  # type: ignore[return-value]

    @property
    def service(self) -> ChatService:
        service = self.kv_app.service
        assert service is not None
        return service

    def on_engine(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the engine thread (anything touching the model); await the result.

        Every call is a user's action: housekeeping running or queued ahead of it (the
        settle and the snapshot write after a reply) yields first, so the action starts
        at once; as the action's work starts, housekeeping is allowed again.
        """
        app = self.kv_app
        if app.service is not None:
            app.service.interrupt_housekeeping()
        self._engine_actions += 1
        self._engine_jobs += 1
        future = app.engine_thread.run(_user_job, app, fn, *args, **kwargs)
        future.add_done_callback(self._engine_job_done)
        return future

    def _engine_job_done(self, _future: object) -> None:
        self._engine_jobs -= 1

    def on_store(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the store thread (reads and store-only writes); await the result."""
        return self.kv_app.store_thread.run(fn, *args, **kwargs)

    def idle_or_say(self) -> bool:
        """Whether the model is loaded and no reply is being generated; else says to wait."""
        if not self.ready or self.turn is not None:
            self.notify("Wait for the model to be ready and idle", severity="warning")
            return False
        return True

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def conversation(self) -> Conversation:
        return self.query_one(Conversation)

    @property
    def sessions(self) -> SessionList:
        return self.query_one(SessionList)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    def _idle(self, what: str) -> bool:
        """True when no reply is being generated; else say that ``what`` has to wait."""
        if self.turn is not None:
            self.notify(f"Cannot {what} during a reply (Esc stops it)", severity="warning")
            return False
        return True

    def _focused_message(self) -> MessageView | None:
        focused = self.focused
        return focused if isinstance(focused, MessageView) else None


def _user_job(app: KvchatApp, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """On the engine thread: a user's action starts; housekeeping may run again after it."""
    if app.service is not None:
        app.service.allow_housekeeping()
    return fn(*args, **kwargs)
