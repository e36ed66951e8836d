"""The main screen's session actions (new, rename, delete, search, export, settings, copy).

A mixin of MainScreen, kept apart so each file stays small. Like the rest of the UI it
only presents: store-only calls go to the store thread, anything touching the engine to
the engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.format import code_blocks, shorten, slug, visible
from kvchat.tui.screens.dialogs import (
    CodePickerDialog,
    ConfirmDialog,
    ExportDialog,
    ExportRequest,
    SessionSettings,
    SettingsDialog,
    TextDialog,
)
from kvchat.tui.screens.search import SearchScreen
from kvchat.tui.widgets.conversation import MessageView

if TYPE_CHECKING:
    from kvchat.chat import SearchHit


class SessionActions(ScreenBase):
    def _need_session(self, what: str) -> str | None:
        if self.session_id is None:
            self.notify(f"No session to {what} yet: send a message first", severity="warning")
        return self.session_id

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
        session_id = self._need_session("delete")
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
        async def searcher(query: str) -> list[SearchHit]:
            result: list[SearchHit] = await self.on_store(self.service.search, query)
            return result

        hit: SearchHit | None = await self.app.push_screen_wait(SearchScreen(searcher))
        if hit is not None:
            self.open_session(hit.message.session_id, highlight=hit.message.id)

    @work(group="action", exit_on_error=False)
    async def action_export(self) -> None:
        session_id = self._need_session("export")
        if session_id is None:
            return
        request: ExportRequest | None = await self.app.push_screen_wait(
            ExportDialog(Path.cwd(), slug(self._title(session_id)))
        )
        if request is None:
            return
        try:
            text = await self.on_store(self.service.export, session_id, request.fmt)
            await self.on_store(_write_text, request.path, text)
        except (KvchatError, OSError) as exc:
            message = f"Export failed: {getattr(exc, 'strerror', None) or exc}"
            self.notify(message, severity="error", markup=False)
            return
        self.notify(f"Exported to {request.path}", markup=False)

    @work(group="action", exit_on_error=False)
    async def action_settings(self) -> None:
        session_id = self.session_id
        if session_id is None:
            session_id = self.session_id = await self._new_session_id()
            await self.refresh_sessions()
        session = await self.on_store(self.service.resolve, session_id)
        from kvchat.chat import SESSION_SETTINGS

        defaults = {key: getattr(self.kv_app.settings, key) for key in SESSION_SETTINGS}
        result: SessionSettings | None = await self.app.push_screen_wait(
            SettingsDialog(visible(session.system_prompt or ""), dict(session.settings), defaults)
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
        self.notify("Session settings saved; they apply from the next reply")

    # --- copy -----------------------------------------------------------------------------

    def _selected_view(self) -> MessageView | None:
        focused = self._focused_message()
        if focused is not None:
            return focused
        views = self.conversation.views
        replies = [v for v in views if v.role == "assistant" and not v.streaming]
        return replies[-1] if replies else (views[-1] if views else None)

    def action_copy_message(self) -> None:
        view = self._selected_view()
        if view is None or not view.text:
            self.notify("No message to copy", severity="warning")
            return
        self._copy(view.text, "message")

    @work(group="action", exit_on_error=False)
    async def action_copy_code(self, view: MessageView | None = None) -> None:
        focused = view or self._focused_message()
        sources = [focused] if focused is not None else self.conversation.views
        blocks = [b for v in sources for b in code_blocks(v.text)]
        if not blocks:
            self.notify("No code block to copy", severity="warning")
            return
        if len(blocks) == 1:
            self._copy(blocks[0], "code block")
            return
        picked = await self.app.push_screen_wait(CodePickerDialog(blocks[::-1]))
        if picked is not None:
            self._copy(picked, "code block")

    def _copy(self, text: str, what: str) -> None:
        self.app.copy_to_clipboard(text)
        lines = text.count("\n") + 1
        self.notify(f"Copied the {what} ({lines} line{'s' if lines != 1 else ''})")


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
