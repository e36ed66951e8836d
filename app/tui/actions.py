"""The main screen's session actions (new, rename, delete, search, export, settings, copy).

A mixin of MainScreen, kept apart so each file stays small. Like the rest of the UI it
only presents: store-only calls go to the store thread, anything touching the engine to
the engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.format import code_blocks, shorten, slug
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
    from collections.abc import Awaitable

    from textual.screen import Screen
    from textual.worker import Worker

    from kvchat.chat import ChatService
    from kvchat.store import SearchHit
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.main import ActiveTurn
    from kvchat.tui.widgets.conversation import Conversation
    from kvchat.tui.widgets.sidebar import SessionList, SessionRow
    from kvchat.tui.widgets.status import StatusBar

    _Base = Screen[None]
else:
    _Base = object


class SessionActions(_Base):
    if TYPE_CHECKING:  # provided by MainScreen
        session_id: str | None
        turn: ActiveTurn | None
        _shown_id: str | None
        _hot_id: str | None
        kv_app: KvchatApp
        service: ChatService
        status: StatusBar
        sessions: SessionList
        conversation: Conversation

        def on_store(self, fn: Any, *args: Any, **kwargs: Any) -> Awaitable[Any]: ...
        def on_engine(self, fn: Any, *args: Any, **kwargs: Any) -> Awaitable[Any]: ...
        async def refresh_sessions(self) -> None: ...
        def _session_rows(self) -> list[SessionRow]: ...
        async def _new_session_id(self) -> str: ...
        def open_session(
            self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
        ) -> Worker[None]: ...

    def _idle(self, what: str) -> bool:
        if self.turn is not None:
            self.notify(f"Cannot {what} during a reply (Esc stops it)", severity="warning")
            return False
        return True

    def _need_session(self, what: str) -> str | None:
        if self.session_id is None:
            self.notify(f"No session to {what} yet: send a message first", severity="warning")
        return self.session_id

    def _title(self, session_id: str) -> str:
        row = self.sessions.row(session_id)
        return row.summary.session.title if row else session_id

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
            SettingsDialog(session.system_prompt or "", dict(session.settings), defaults)
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
        focused = self.focused
        if isinstance(focused, MessageView):
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
        focused = view or (self.focused if isinstance(self.focused, MessageView) else None)
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
