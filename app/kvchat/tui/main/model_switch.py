"""Picking the model inside the app (F9 in the key table), and saying which model a session was made with.

The choices are listed on the store thread (the catalog, the
models dir and the planner's fit: no model work); the switch runs on the engine thread,
like the first load, while the screen holds new messages back. A session made with another
model that is here is named in the status line when it is opened, and the picker starts on
that model: switching costs a model load, so it is never done without the user.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.tui.backend import Backend
from kvchat.tui.keys import KEYS
from kvchat.tui.main.opener import READY_PLACEHOLDER, SessionOpener
from kvchat.tui.main.screen_state import ScreenState
from kvchat.tui.main.signals import Fatal
from kvchat.tui.screens.model_picker import ModelScreen
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.status import StatusBar

if TYPE_CHECKING:
    from textual.app import App
    from textual.message import Message as TextualMessage

    from kvchat.service.model_choices import ModelChoice, SessionModel

# The picker's key, as the key table names it.
PICK_KEY = next(k.label for k in KEYS if k.action == "pick_model")


class ModelSwitch:
    """The model picker and the note on a session's model (see the module docstring)."""

    def __init__(
        self,
        app: App[Any],
        backend: Backend,
        state: ScreenState,
        *,
        opener: SessionOpener,
        status: StatusBar,
        prompt: PromptInput,
        post: Callable[[TextualMessage], bool],
    ) -> None:
        self.app = app
        self.backend = backend
        self.state = state
        self.opener = opener
        self.status = status
        self.prompt = prompt
        self.post = post  # to the screen

    async def pick(self) -> None:
        """F9: list the models with their fit; load the one picked (Enter)."""
        service = self.backend.chat
        remembered = await self._other_model(self.state.session_id)
        also = remembered.path if remembered is not None else None
        choices = await self.backend.on_store(service.models.model_choices, also)
        note = _made_with(remembered) if remembered is not None else None
        choice: ModelChoice | None = await self.app.push_screen_wait(
            ModelScreen(choices, also, note)
        )
        if choice is None or choice.loaded or choice.path is None:
            return
        if self.state.turn is not None:  # a reply started meanwhile (a key pressed behind)
            self.app.notify("Wait for the reply, then pick the model again", severity="warning")
            return
        await self._switch_model(choice)

    async def _switch_model(self, choice: ModelChoice) -> None:
        """Load ``choice`` on the engine thread; messages wait (not ready) until it is in."""
        assert choice.path is not None
        self.state.ready = False
        self.status.set_turn(f"loading model {choice.name}…", "busy")
        try:
            name, n_ctx, note = await self.backend.on_engine(
                self.backend.switch_model, str(choice.path)
            )
        except KvchatError as exc:
            self.app.notify(str(exc), title="Model not switched", severity="error", markup=False)
            try:  # the service loaded the previous model again
                name, n_ctx, note = await self.backend.on_engine(self.backend.load_model)
            except KvchatError as again:
                self.post(Fatal("The model could not be loaded", str(again)))
                return
        self.state.ready = True
        self.state.hot_id = None  # the new context holds no session's KV
        self.status.set_model(name, n_ctx)
        self.status.set_context(0)
        self.prompt.placeholder = READY_PLACEHOLDER
        self.status.set_turn(f"{name} loaded · {note}" if note else f"{name} loaded")
        if self.state.session_id is not None:
            await self.opener.make_hot(self.state.session_id, note=note)

    async def note_session_model(self, session_id: str) -> None:
        """Name the model ``session_id`` was made with when it is another one that is here."""
        remembered = await self._other_model(session_id)
        if (
            remembered is not None
            and session_id == self.state.session_id
            and self.state.turn is None
        ):
            self.status.set_turn(f"{_made_with(remembered)} · {PICK_KEY} switches")

    async def _other_model(self, session_id: str | None) -> SessionModel | None:
        """The model the session last ran with, when it is here and not the loaded one."""
        if session_id is None or not self.state.ready:
            return None
        remembered = await self.backend.on_store(self.backend.chat.models.session_model, session_id)
        if remembered is None or remembered.loaded or not remembered.present:
            return None
        return remembered


def _made_with(model: SessionModel) -> str:
    return f"This session was made with {model.name}"
