"""Picking the model inside the app (F9 in the key table), and saying which model a session was made with.

A mixin of MainScreen. The choices are listed on the store thread (the catalog, the
models dir and the planner's fit: no model work); the switch runs on the engine thread,
like the first load, while the screen holds new messages back. A session made with another
model that is here is named in the status line when it is opened, and the picker starts on
that model: switching costs a model load, so it is never done without the user.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.keys import KEYS
from kvchat.tui.opening import READY_PLACEHOLDER
from kvchat.tui.screens.models import ModelScreen

if TYPE_CHECKING:
    from kvchat.service.model_choices import ModelChoice, SessionModel

# The picker's key, as the key table names it.
PICK_KEY = next(k.label for k in KEYS if k.action == "pick_model")


class ModelActions(ScreenBase):
    """The model picker's actions (see the module docstring). MainScreen lists it before
    SessionOpening, whose ``_make_hot`` (run whenever a session is opened) it extends."""

    if TYPE_CHECKING:  # SessionOpening's

        def _engine_load(self) -> tuple[str, int, str | None]: ...

    async def _make_hot(
        self, session_id: str, started: float | None = None, note: str | None = None
    ) -> None:
        """Make the session hot (SessionOpening), then name the model it was made with
        when that is another one."""
        await super()._make_hot(session_id, started=started, note=note)  # type: ignore[misc]
        await self.note_session_model(session_id)

    def action_pick_model(self) -> None:
        if not self.idle_or_say():
            return
        self.pick_model()

    @work(group="models", exclusive=True, exit_on_error=False)
    async def pick_model(self) -> None:
        service = self.service
        remembered = await self._other_model(self.session_id)
        also = remembered.path if remembered is not None else None
        choices = await self.on_store(service.model_choices, also)
        note = _made_with(remembered) if remembered is not None else None
        choice: ModelChoice | None = await self.app.push_screen_wait(
            ModelScreen(choices, also, note)
        )
        if choice is None or choice.loaded or choice.path is None:
            return
        if self.turn is not None:  # a reply started meanwhile (a key pressed behind)
            self.notify("Wait for the reply, then pick the model again", severity="warning")
            return
        await self._switch_model(choice)

    async def _switch_model(self, choice: ModelChoice) -> None:
        """Load ``choice`` on the engine thread; messages wait (not ready) until it is in."""
        assert choice.path is not None
        self.ready = False
        self.status.set_turn(f"loading model {choice.name}…", "busy")
        try:
            name, n_ctx, note = await self.on_engine(self._engine_switch, str(choice.path))
        except KvchatError as exc:
            self.notify(str(exc), title="Model not switched", severity="error", markup=False)
            try:  # the service loaded the previous model again
                name, n_ctx, note = await self.on_engine(self._engine_load)
            except KvchatError as again:
                self.kv_app.show_model_error(again)
                return
        self.ready = True
        self._hot_id = None  # the new context holds no session's KV
        self.status.set_model(name, n_ctx)
        self.status.set_context(0)
        self.prompt.placeholder = READY_PLACEHOLDER
        self.status.set_turn(f"{name} loaded · {note}" if note else f"{name} loaded")
        if self.session_id is not None:
            await self._make_hot(self.session_id, note=note)

    def _engine_switch(self, path: str) -> tuple[str, int, str | None]:
        """On the engine thread: switch, then what the status bar shows of the model."""
        self.service.switch_model(path)
        return self._engine_load()

    async def note_session_model(self, session_id: str) -> None:
        """Name the model ``session_id`` was made with when it is another one that is here."""
        remembered = await self._other_model(session_id)
        if remembered is not None and session_id == self.session_id and self.turn is None:
            self.status.set_turn(f"{_made_with(remembered)} · {PICK_KEY} switches")

    async def _other_model(self, session_id: str | None) -> SessionModel | None:
        """The model the session last ran with, when it is here and not the loaded one."""
        if session_id is None or not self.ready:
            return None
        remembered = await self.on_store(self.service.session_model, session_id)
        if remembered is None or remembered.loaded or not remembered.present:
            return None
        return remembered  # type: ignore[no-any-return]


def _made_with(model: SessionModel) -> str:
    return f"This session was made with {model.name}"
