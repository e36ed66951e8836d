"""The main screen's session actions (new, rename, delete, search, export, settings).

Like the rest of the UI it only presents: store-only calls go to the store thread,
anything touching the engine to the engine thread. Each action runs in a worker of the
screen (the dialogs are awaited with ``push_screen_wait``); a session to open is asked
for with an ``OpenRequested`` message.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.text import visible
from kvchat.tui.main.context import ScreenContext
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.screen_state import idle_or_say, ready_or_say
from kvchat.tui.main.signals import OpenRequested
from kvchat.tui.phrases import shorten, slug

# The dialogs and screens are imported when first opened, not before the first frame.
if TYPE_CHECKING:
    from kvchat.service.chat import SearchHit
    from kvchat.tui.screens.dialogs import ExportRequest, SessionSettings


# Imported messages are counted this many at a time, after this pause (see count_tokens).
COUNT_BATCH = 256
COUNT_PAUSE_S = 0.5


class SessionActions:
    """New, rename, delete, search, export and the session's settings (see the module
    docstring)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener

    def _need_session(self, what: str) -> str | None:
        if self.ctx.state.session_id is None:
            self.ctx.app.notify(
                f"No session to {what} yet: send a message first", severity="warning"
            )
        return self.ctx.state.session_id

    def _highlighted_session(self) -> str | None:
        """The session highlighted in the sidebar, when the sidebar has focus (what F8 acts
        on there); else None (the open session is meant)."""
        sessions = self.ctx.sessions
        if self.ctx.app.focused is not sessions or sessions.index is None:
            return None
        rows = sessions.rows
        return rows[sessions.index].id if 0 <= sessions.index < len(rows) else None

    def _title(self, session_id: str) -> str:
        row = self.ctx.sessions.row(session_id)
        return visible(row.summary.session.title) if row else session_id

    async def new_session(self) -> None:
        if not idle_or_say(self.ctx.app, self.ctx.state, "start a session"):
            return
        session_id = await self.opener.new_session_id()
        await self.ctx.refresh()
        self.ctx.post(OpenRequested(session_id, focus_prompt=True))

    async def rename(self) -> None:
        from kvchat.tui.screens.dialogs import TextDialog

        session_id = self._need_session("rename")
        if session_id is None:
            return
        title = await self.ctx.app.push_screen_wait(
            TextDialog("Rename session", self._title(session_id), "a title")
        )
        if not title:
            return
        try:
            await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.rename, session_id, title
            )
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        await self.ctx.refresh()

    async def delete(self) -> None:
        from kvchat.tui.screens.dialogs import ConfirmDialog

        session_id = self._highlighted_session() or self._need_session("delete")
        if session_id is None or not idle_or_say(self.ctx.app, self.ctx.state, "delete a session"):
            return
        title = self._title(session_id)
        confirmed = await self.ctx.app.push_screen_wait(
            ConfirmDialog(
                f"Delete “{shorten(title, 40)}”?",
                "Its messages and its saved memory (KV snapshot) are removed for good.",
            )
        )
        if not confirmed or self.ctx.state.turn is not None:
            return
        await self.ctx.backend.on_engine(self.ctx.backend.chat.sessions.delete, session_id)
        self.ctx.app.notify(f"Deleted “{shorten(title, 40)}”", markup=False)
        if self.ctx.state.session_id == session_id:
            self.ctx.state.session_id = self.ctx.state.shown_id = self.ctx.state.hot_id = None
            self.ctx.status.set_memory("")
            self.ctx.status.set_turn("")
            await self.ctx.conversation.show([])
        await self.ctx.refresh()
        newest = self.ctx.sessions.newest
        if self.ctx.state.session_id is None and newest is not None:
            self.ctx.post(OpenRequested(newest))

    async def pin(self) -> None:
        """Shift+F3: pin the session (highlighted in the list when it has focus, else the
        open one) so it comes first in the list, or unpin it."""
        session_id = self._highlighted_session() or self._need_session("pin")
        if session_id is None:
            return
        sessions = self.ctx.backend.chat.sessions
        try:
            session = await self.ctx.backend.on_store(sessions.resolve, session_id)
            await self.ctx.backend.on_store(sessions.pin, session_id, not session.pinned)
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        await self.ctx.refresh()
        title = shorten(self._title(session_id), 40)
        if session.pinned:
            self.ctx.app.notify(f"Unpinned “{title}”", markup=False, timeout=3)
        else:
            self.ctx.app.notify(
                f"Pinned “{title}”: listed first (Shift+F3 unpins)", markup=False, timeout=3
            )

    async def count_tokens(self, session_id: str) -> None:
        """Once a session is hot: the model counts the tokens of its messages that came
        without a count (imported), and the list shows the session's size from then on
        (stored: ``kvchat list`` says the same). A batch at a time while the session stays
        open and nothing else waits for the engine, so a switch or a turn never queues
        behind more than one batch."""
        backend, state = self.ctx.backend, self.ctx.state
        counted = 0
        while True:
            await asyncio.sleep(COUNT_PAUSE_S)
            if state.session_id != session_id or state.turn is not None or backend.engine_jobs:
                break
            # Not on_engine: that is a user's action, and makes the housekeeping after a
            # reply (the settle, the snapshot write) yield to it.
            batch = await backend.engine_thread.run(
                backend.chat.sessions.count_tokens, session_id, COUNT_BATCH
            )
            counted += batch
            if batch < COUNT_BATCH:
                break
        if counted:
            await self.ctx.refresh()

    async def search(self) -> None:
        from kvchat.tui.screens.search import SearchScreen

        async def searcher(query: str) -> list[SearchHit]:
            result: list[SearchHit] = await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.search, query
            )
            return result

        hit: SearchHit | None = await self.ctx.app.push_screen_wait(SearchScreen(searcher))
        if hit is not None:
            self.ctx.post(OpenRequested(hit.message.session_id, highlight=hit.message.id))

    async def export(self) -> None:
        from kvchat.tui.screens.dialogs import ExportDialog

        session_id = self._need_session("export")
        if session_id is None:
            return
        request: ExportRequest | None = await self.ctx.app.push_screen_wait(
            ExportDialog(exports_dir(), slug(self._title(session_id)))
        )
        if request is None:
            return
        try:
            text = await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.export, session_id, request.fmt
            )
            await self.ctx.backend.on_store(_write_text, request.path, text, request.replace)
        except FileExistsError:
            message = f"Not exported: {request.path} exists now (export again to replace it)"
            self.ctx.app.notify(message, severity="error", markup=False)
            return
        except (KvchatError, OSError) as exc:
            message = f"Export failed: {getattr(exc, 'strerror', None) or exc}"
            self.ctx.app.notify(message, severity="error", markup=False)
            return
        self.ctx.app.notify(f"Exported to {request.path}", markup=False)

    async def settings(self) -> None:
        from kvchat.paths import config_file
        from kvchat.tui.presets import load_presets
        from kvchat.tui.screens.dialogs import SettingsDialog, reread_note

        session_id = self.ctx.state.session_id
        if session_id is None:
            session_id = self.ctx.state.session_id = await self.opener.new_session_id()
            await self.ctx.refresh()
        session = await self.ctx.backend.on_store(
            self.ctx.backend.chat.sessions.resolve, session_id
        )
        from kvchat.service.chat import SESSION_SETTINGS

        settings = self.ctx.backend.settings
        defaults = {key: getattr(settings, key) for key in SESSION_SETTINGS}
        presets, problem = await self.ctx.backend.on_store(load_presets)
        if problem:
            self.ctx.app.notify(problem, severity="warning", markup=False)
        row = self.ctx.sessions.row(session_id)
        history = row.tokens if row is not None and row.summary.messages else 0
        # The session's switches (thinking) are not in the dialog: saving keeps them.
        from kvchat.service.reports import SESSION_SWITCHES

        kept = {k: v for k, v in session.settings.items() if k in SESSION_SWITCHES}
        result: SessionSettings | None = await self.ctx.app.push_screen_wait(
            SettingsDialog(
                visible(session.system_prompt or ""),
                dict(session.settings),
                defaults,
                n_ctx=self.ctx.status.n_ctx or settings.n_ctx,
                presets=presets,
                config_path=str(config_file()),
                history_tokens=history,
                tags=" ".join(f"#{t}" for t in session.tags),
                check_tags=self.ctx.backend.chat.sessions.tags_problem,
            )
        )
        if result is None:
            return
        try:
            await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.configure,
                session_id,
                system_prompt=result.system_prompt,
                settings={**kept, **result.settings},
            )
            await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.tag, session_id, result.tags
            )
            await self.ctx.refresh()
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        note = reread_note(visible(session.system_prompt or ""), result.system_prompt, history)
        if note:
            self.ctx.app.notify(
                f"Session settings saved. The next reply re-reads the conversation (about "
                f"{history:,} tokens) under the new system prompt",
                markup=False,
            )
        else:
            self.ctx.app.notify("Session settings saved; they apply from the next reply")

    async def toggle_thinking(self) -> None:
        """Ctrl+/: turn the open session's thinking off, or on again, through the model's
        own template switch (``enable_thinking``…); a template without one says so."""
        if not ready_or_say(self.ctx.app, self.ctx.state):
            return
        service = self.ctx.backend.chat
        switch = await self.ctx.backend.on_engine(lambda: service.host.thinking_switch)
        if switch.keyword is None:
            message = "this model's chat template has no thinking switch: nothing changed"
            self.ctx.status.set_turn(message, "warning")
            self.ctx.app.notify(message.capitalize(), severity="warning")
            return
        session_id = self.ctx.state.session_id
        if session_id is None:
            session_id = self.ctx.state.session_id = await self.opener.new_session_id()
            await self.ctx.refresh()
        session = await self.ctx.backend.on_store(service.sessions.resolve, session_id)
        # Unset means the template's default, thinking for the templates that have the
        # switch: the first press turns it off.
        think = session.settings.get("think") is False
        settings = {**session.settings, "think": think}
        try:
            await self.ctx.backend.on_store(
                service.sessions.configure, session_id, settings=settings
            )
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        value = switch.on if think else switch.off
        state = "on" if think else "off"
        self.ctx.status.set_turn(
            f"thinking {state} for this session ({switch.keyword}={value}): from the next reply"
        )
        self.ctx.app.notify(f"Thinking {state} for this session", markup=False)


def _write_text(path: Path, text: str, replace: bool) -> None:
    """Write an export readable by its owner only; never over a file unless ``replace``."""
    from kvchat.paths import ensure_private_dir

    if path.parent == exports_dir():
        ensure_private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    with os.fdopen(os.open(path, flags, 0o600), "w", encoding="utf-8") as fh:
        fh.write(text)


def exports_dir() -> Path:
    """Where exports go by default: ``exports/`` in the data directory."""
    from kvchat.paths import data_dir

    return data_dir() / "exports"
