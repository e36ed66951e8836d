"""Picking the model inside the app (F9 in the key table), and saying which model a session was made with.

The choices are listed on the store thread (the catalog, the
models dir and the planner's fit: no model work); the switch runs on the engine thread,
like the first load, while the screen holds new messages back. A session made with another
model that is here is loaded when the session is opened (``open_with_session_model``, on by
default: said in a notice and the status line); with the setting off it is named in the
status line and the picker starts on it. Ctrl+D in the picker makes the highlighted model the
default one (saved to the config file, and said where).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.tui.keys import KEYS
from kvchat.tui.main.context import SAVE_DEFAULT_MODEL, ScreenContext
from kvchat.tui.main.opener import READY_PLACEHOLDER, SessionOpener, followed_line
from kvchat.tui.main.signals import Fatal
from kvchat.tui.screens.model_picker import ModelScreen

if TYPE_CHECKING:
    from kvchat.service.model_choices import ModelChoice, SessionModel

# The picker's key, as the key table names it.
PICK_KEY = next(k.label for k in KEYS if k.action == "pick_model")


class ModelSwitch:
    """The model picker and the note on a session's model (see the module docstring)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener
        opener.follow_model = self.follow

    async def pick(self) -> None:
        """F9: list the models with their fit; load the one picked (Enter)."""
        service = self.ctx.backend.chat
        remembered = await self._other_model(self.ctx.state.session_id)
        also = remembered.path if remembered is not None else None
        choices = await self.ctx.backend.on_store(service.models.model_choices, also)
        note = _made_with(remembered) if remembered is not None else None
        choice: ModelChoice | None = await self.ctx.app.push_screen_wait(
            ModelScreen(choices, also, note, on_default=self._make_default)
        )
        if choice is None or choice.path is None:
            return
        if choice.loaded:
            self.ctx.app.notify(f"{choice.title} is the model loaded already", markup=False)
            return
        if self.ctx.state.turn is not None:  # a reply started meanwhile (a key pressed behind)
            self.ctx.app.notify("Wait for the reply, then pick the model again", severity="warning")
            return
        await self._switch_model(choice.path, choice.title)

    def _make_default(self, choice: ModelChoice) -> None:
        """Ctrl+D in the picker: ``choice`` becomes the model kvchat starts with."""
        self.ctx.run(SAVE_DEFAULT_MODEL, self._save_default, choice)

    async def _save_default(self, choice: ModelChoice) -> None:
        from kvchat.config_file import save_config_values

        value = "bundled" if choice.source == "bundled" else choice.name
        try:
            path = await asyncio.to_thread(save_config_values, {"model": value})
        except KvchatError as exc:
            self.ctx.app.notify(f"Default model not saved: {exc}", severity="warning", markup=False)
            return
        self.ctx.app.notify(
            f"{choice.title} is the default model now (model = {value!r} in {path})",
            markup=False,
            timeout=10,
        )

    async def follow(self, session_id: str) -> bool:
        """Opening ``session_id``: load the model it was made with when that is here and
        ``open_with_session_model`` is on; True once it is loaded and the session hot."""
        state = self.ctx.state
        if not self.ctx.backend.settings.open_with_session_model or state.turn is not None:
            return False
        remembered = await self._other_model(session_id)
        if remembered is None or session_id != state.session_id or state.turn is not None:
            return False
        return await self._switch_model(remembered.path, remembered.name, followed=True)

    async def _switch_model(self, path: Path, name: str, *, followed: bool = False) -> bool:
        """Load the model file ``path`` on the engine thread (messages wait, not ready, until
        it is in), then make the open session hot; whether it was loaded. ``followed``: it
        is the open session's own model, and that is said."""
        self.ctx.state.ready = False
        self.ctx.status.set_turn(f"loading model {name}…", "busy")
        switched = True
        try:
            name, n_ctx, note = await self.ctx.backend.on_engine(
                self.ctx.backend.switch_model, str(path)
            )
        except KvchatError as exc:
            switched = False
            self.ctx.app.notify(
                str(exc), title="Model not switched", severity="error", markup=False
            )
            try:  # the service loaded the previous model again
                name, n_ctx, note = await self.ctx.backend.on_engine(self.ctx.backend.load_model)
            except KvchatError as again:
                self.ctx.post(Fatal("The model could not be loaded", str(again)))
                return False
        if switched and followed:
            said = followed_line(name)
            self.ctx.app.notify(said, markup=False, timeout=10)
            note = f"{note} · {said}" if note else said
        self.ctx.state.ready = True
        self.ctx.state.hot_id = None  # the new context holds no session's KV
        self.ctx.status.set_model(name, n_ctx)
        self.ctx.status.set_context(0)
        self.ctx.prompt.placeholder = READY_PLACEHOLDER
        self.ctx.status.set_turn(f"{name} loaded · {note}" if note else f"{name} loaded")
        if self.ctx.state.session_id is not None:
            await self.opener.make_hot(self.ctx.state.session_id, note=note)
        return switched

    async def note_session_model(self, session_id: str) -> None:
        """Name the model ``session_id`` was made with when it is another one that is here."""
        remembered = await self._other_model(session_id)
        if (
            remembered is not None
            and session_id == self.ctx.state.session_id
            and self.ctx.state.turn is None
        ):
            self.ctx.status.set_turn(f"{_made_with(remembered)} · {PICK_KEY} switches")

    async def _other_model(self, session_id: str | None) -> SessionModel | None:
        """The model the session last ran with, when it is here and not the loaded one."""
        if session_id is None or not self.ctx.state.ready:
            return None
        return await self.ctx.backend.on_store(self.ctx.backend.chat.models.other_model, session_id)


def _made_with(model: SessionModel) -> str:
    return f"This session was made with {model.name}"
