"""The main screen's session actions (new, rename, delete, search, export, settings).

A mixin of MainScreen, kept apart so each file stays small. Like the rest of the UI it
only presents: store-only calls go to the store thread, anything touching the engine to
the engine thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.format import shorten, slug, visible

# The dialogs and screens are imported when first opened, not before the first frame.
if TYPE_CHECKING:
    from kvchat.service.chat import SearchHit
    from kvchat.tui.screens.dialogs import ExportRequest, SessionSettings


class SessionActions(ScreenBase):
    def _need_session(self, what: str) -> str | None:
        if self.session_id is None:
            self.notify(f"No session to {what} yet: send a message first", severity="warning")
        return self.session_id

    def _highlighted_session(self) -> str | None:
        """The session highlighted in the sidebar, when the sidebar has focus (what F8 acts
        on there); else None (the open session is meant)."""
        sessions = self.sessions
        if self.focused is not sessions or sessions.index is None:
            return None
        rows = sessions.rows
        return rows[sessions.index].id if 0 <= sessions.index < len(rows) else None

    def _title(self, session_id: str) -> str:
        row = self.sessions.row(session_id)
        return visible(row.summary.session.title) if row else session_id

    @work(group="action", exit_on_error=False)
    async def action_new_session(self) -> None:
        if not self._idle("start a session"):
            return
        session_id = await self._new_session_id()
        await self.refresh_sessions()
        self.open_session(session_id, focus_prompt=True)

    @work(group="action", exit_on_error=False)
    async def action_rename(self) -> None:
        from kvchat.tui.screens.dialogs import TextDialog

        session_id = self._need_session("rename")
        if session_id is None:
            return
        title = await self.app.push_screen_wait(
            TextDialog("Rename session", self._title(session_id), "a title")
        )
        if not title:
            return
        try:
            await self.on_store(self.service.rename, session_id, title)
        except KvchatError as exc:
            self.notify(str(exc), severity="error", markup=False)
            return
        await self.refresh_sessions()

    @work(group="action", exit_on_error=False)
    async def action_delete(self) -> None:
        from kvchat.tui.screens.dialogs import ConfirmDialog

        session_id = self._highlighted_session() or self._need_session("delete")
        if session_id is None or not self._idle("delete a session"):
            return
        title = self._title(session_id)
        confirmed = await self.app.push_screen_wait(
            ConfirmDialog(
                f"Delete “{shorten(title, 40)}”?",
                "Its messages and its saved memory (KV snapshot) are removed for good.",
            )
        )
        if not confirmed or self.turn is not None:
            return
        await self.on_engine(self.service.delete, session_id)
        self.notify(f"Deleted “{shorten(title, 40)}”", markup=False)
        rows = await self.on_store(self._session_rows)
        if self.session_id == session_id:
            self.session_id = self._shown_id = self._hot_id = None
            self.status.set_memory("")
            self.status.set_turn("")
            await self.conversation.show([])
        await self.sessions.show(rows, self.session_id)
        if self.session_id is None and rows:
            self.open_session(rows[0].id)

    @work(group="action", exit_on_error=False)
    async def action_search(self) -> None:
        from kvchat.tui.screens.search import SearchScreen

        async def searcher(query: str) -> list[SearchHit]:
            result: list[SearchHit] = await self.on_store(self.service.search, query)
            return result

        hit: SearchHit | None = await self.app.push_screen_wait(SearchScreen(searcher))
        if hit is not None:
            self.open_session(hit.message.session_id, highlight=hit.message.id)

    @work(group="action", exit_on_error=False)
    async def action_export(self) -> None:
        from kvchat.tui.screens.dialogs import ExportDialog

        session_id = self._need_session("export")
        if session_id is None:
            return
        request: ExportRequest | None = await self.app.push_screen_wait(
            ExportDialog(exports_dir(), slug(self._title(session_id)))
        )
        if request is None:
            return
        try:
            text = await self.on_store(self.service.export, session_id, request.fmt)
            await self.on_store(_write_text, request.path, text, request.replace)
        except FileExistsError:
            message = f"Not exported: {request.path} exists now (export again to replace it)"
            self.notify(message, severity="error", markup=False)
            return
        except (KvchatError, OSError) as exc:
            message = f"Export failed: {getattr(exc, 'strerror', None) or exc}"
            self.notify(message, severity="error", markup=False)
            return
        self.notify(f"Exported to {request.path}", markup=False)

    @work(group="action", exit_on_error=False)
    async def action_settings(self) -> None:
        from kvchat.config import config_file  # pydantic: not before the first frame
        from kvchat.tui.presets import load_presets
        from kvchat.tui.screens.dialogs import SettingsDialog, reread_note

        session_id = self.session_id
        if session_id is None:
            session_id = self.session_id = await self._new_session_id()
            await self.refresh_sessions()
        session = await self.on_store(self.service.resolve, session_id)
        from kvchat.service.chat import SESSION_SETTINGS

        settings = self.kv_app.settings
        defaults = {key: getattr(settings, key) for key in SESSION_SETTINGS}
        presets, problem = await self.on_store(load_presets)
        if problem:
            self.notify(problem, severity="warning", markup=False)
        row = self.sessions.row(session_id)
        history = row.tokens if row is not None and row.summary.messages else 0
        result: SessionSettings | None = await self.app.push_screen_wait(
            SettingsDialog(
                visible(session.system_prompt or ""),
                dict(session.settings),
                defaults,
                n_ctx=self.status.n_ctx or settings.n_ctx,
                presets=presets,
                config_path=str(config_file()),
                history_tokens=history,
            )
        )
        if result is None:
            return
        try:
            await self.on_store(
                self.service.configure,
                session_id,
                system_prompt=result.system_prompt,
                settings=result.settings,
            )
        except KvchatError as exc:
            self.notify(str(exc), severity="error", markup=False)
            return
        note = reread_note(visible(session.system_prompt or ""), result.system_prompt, history)
        if note:
            self.notify(
                f"Session settings saved. The next reply re-reads the conversation (about "
                f"{history:,} tokens) under the new system prompt",
                markup=False,
            )
        else:
            self.notify("Session settings saved; they apply from the next reply")


def _write_text(path: Path, text: str, replace: bool) -> None:
    """Write an export readable by its owner only; never over a file unless ``replace``."""
    from kvchat.config import ensure_private_dir

    if path.parent == exports_dir():
        ensure_private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    with os.fdopen(os.open(path, flags, 0o600), "w", encoding="utf-8") as fh:
        fh.write(text)


def exports_dir() -> Path:
    """Where exports go by default: ``exports/`` in the data directory."""
    from kvchat.config import data_dir  # pydantic: not before the first frame

    return data_dir() / "exports"
