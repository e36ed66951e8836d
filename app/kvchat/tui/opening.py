"""Opening sessions on the main screen: start-up, the sidebar, switching, resume before Enter.

A mixin of MainScreen. A session is drawn first (only the messages that fill the screen),
then its KV is brought back on the engine thread at once, before the user types: the first
message after a switch or a relaunch then decodes only itself. The session the app has
open is remembered, so a relaunch reopens it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.format import restore_phrase
from kvchat.tui.widgets.sidebar import SessionRow

if TYPE_CHECKING:
    from kvchat.service.chat import Message, RestoreResult
    from kvchat.tui.app import KvchatApp

READY_PLACEHOLDER = "Message (Enter sends · Ctrl+J new line · F1 keys)"
LOADING_PLACEHOLDER = "Loading the model… (you can type already)"


class SessionOpening(ScreenBase):
    """Start-up, the sessions list and opening a session (see the module docstring)."""

    # --- start ----------------------------------------------------------------------------

    @work(group="startup", exit_on_error=False)
    async def startup(self) -> None:
        app = self.kv_app
        if app.service is None:
            try:
                await self.on_engine(_open_service, app)
            except KvchatError as exc:
                app.show_fatal("kvchat cannot open its data", str(exc))
                return
        service = self.service
        # The session the user was in when the app last quit (not the last one a CLI
        # `ask` or a fork touched).
        last = await self.on_store(service.last_open_session)
        if last is not None:
            self.session_id = last.id
            await self._show_stored(last.id)
        else:
            await self.conversation.show([])
        await self.refresh_sessions()
        self.status.set_turn(f"loading model {app.model_label}…", "busy")
        loading = self.on_engine(self._engine_load)
        await self.conversation.fill()  # the earlier messages, while the model loads
        try:
            name, n_ctx, note = await loading
        except KvchatError as exc:
            app.show_model_error(exc)
            return
        self.ready = True
        # The last run's crash, the engine probe's choice: said once.
        for notice in await self.on_store(self.service.startup_notices):
            self.notify(notice, severity="warning", timeout=20, markup=False)
        self.status.set_model(name, n_ctx)
        self.status.set_context(0)
        self.prompt.placeholder = READY_PLACEHOLDER
        self.status.set_turn(f"ready · {note}" if note else "ready")
        app.ready_at = time.perf_counter()
        if self.session_id is not None:
            # Resume before Enter: the reopened session's KV comes back before the first
            # message, so that message decodes only itself.
            await self._make_hot(self.session_id, note=note)

    def _engine_load(self) -> tuple[str, int, str | None]:
        # A turn returns once its reply is stored; the app runs the settle and the snapshot
        # write while idle, and a new message makes them yield (see replies).
        self.service.defer_housekeeping = True
        engine = self.service.load_engine()
        return engine.config.model_path.stem, engine.n_ctx, self.service.plan_note

    # --- the sessions list ----------------------------------------------------------------

    async def refresh_sessions(self) -> None:
        rows = await self.on_store(self._session_rows)
        await self.sessions.show(self._with_context(rows), self.session_id)

    def _with_context(self, rows: list[SessionRow]) -> list[SessionRow]:
        """The open session's row with the context gauge's figure: one number for both."""
        if self._hot_id is None or self._hot_id != self.session_id:
            return rows
        used = self.status.used
        return [replace(r, context=used) if r.id == self._hot_id else r for r in rows]

    def _session_rows(self) -> list[SessionRow]:
        service = self.service
        return [SessionRow(s, service.kv_location(s.session.id)) for s in service.list_sessions()]

    @work(group="sidebar", exclusive=True, exit_on_error=False)
    async def request_refresh(self) -> None:
        await self.refresh_sessions()

    async def _new_session_id(self) -> str:
        session = await self.on_store(self.service.new_session)
        self.made_sessions.add(session.id)  # dropped at quit if it never gets a message
        await self.on_store(self.service.remember_open, session.id)
        return str(session.id)

    # --- making a session hot -------------------------------------------------------------

    def _engine_make_hot(self, session_id: str) -> tuple[RestoreResult, int]:
        """On the engine thread: make the session hot (a new branch borrows its shared
        prefix from another session's snapshot) and report the context's size."""
        result = self.service.make_hot(session_id)
        return result, self.service.context_tokens

    async def _make_hot(
        self, session_id: str, started: float | None = None, note: str | None = None
    ) -> None:
        """Bring the session's KV into the context on the engine thread, and say where it
        came from; the status line tells that the next message reads only itself."""
        if not self.ready or session_id == self._hot_id:
            return
        started = time.perf_counter() if started is None else started
        self.status.set_memory("KV: restoring…", "busy")
        result, used = await self.on_engine(self._engine_make_hot, session_id)
        if session_id != self.session_id:
            return
        self._hot_id = session_id
        self.last_switch_ms = (time.perf_counter() - started) * 1000
        self.last_restore = result
        self.status.set_memory(f"KV: {restore_phrase(result)}", result.source)
        self.status.set_context(used if result.source != "none" else 0)
        if result.source in ("ram", "disk") and self.turn is None:
            ready = f"KV ready: {restore_phrase(result)}; the next message reads only itself"
            self.status.set_turn(f"{ready} · {note}" if note else ready)
        self.request_refresh()

    # --- opening ----------------------------------------------------------------------------

    async def _show_stored(
        self, session_id: str, highlight: int | None = None, lazy: bool = True
    ) -> None:
        """Show the session's stored messages (the latest, or a window around
        ``highlight``); note when they last changed, for the watch on other processes."""
        stamp, messages, version = await self.on_store(self._stored, session_id)
        await self.conversation.show(messages, around=highlight, lazy=lazy)
        last = self.conversation.last_view
        if last is not None and not self.conversation.later and last.role == "assistant":
            last.set_version(*version)
        self.seen_change = (session_id, stamp)
        self._shown_id = session_id

    def _stored(self, session_id: str) -> tuple[str, list[Message], tuple[int, int]]:
        """On the store thread: when the session last changed, its messages, and which
        version of its last reply is current, of how many (only that reply switches)."""
        service = self.service
        stamp, messages = service.changed_at(session_id), service.messages(session_id)
        last = messages[-1] if messages else None
        version = (1, 1)
        if last is not None and last.role == "assistant":
            version = service.reply_versions(last.id)
        return stamp, messages, version

    @work(group="open", exclusive=True, exit_on_error=False)
    async def open_session(
        self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
    ) -> None:
        """Show a session's messages, then make it hot on the engine thread."""
        if self.turn is not None and session_id != self.session_id:
            self.notify("A reply is being generated: Esc stops it", severity="warning")
            self.sessions.highlight(self.session_id)
            return
        started = time.perf_counter()
        # One batch from here to the focus: no frame is drawn until the new session is
        # in place (each frame costs tens of ms on a busy machine).
        with self.app.batch_update():
            if session_id != self.session_id:
                self.status.set_turn("")
            self.session_id = session_id
            self.sessions.highlight(session_id)
            shown = session_id == self._shown_id
            if not shown or (highlight is not None and self.conversation.find(highlight) is None):
                self._shown_id = None
                # Only the messages that fill the screen are built now (or the window
                # around the hit); the rest after the restore (fill below).
                await self._show_stored(session_id, highlight)
                if highlight is not None:
                    self._jump_to(highlight)
            elif highlight is not None:
                self._jump_to(highlight)
            if highlight is not None:
                self.last_jump_ms = (time.perf_counter() - started) * 1000
            elif focus_prompt:
                # Now, not after this frame (Widget.focus waits for one): one frame for all.
                self.set_focus(self.prompt, scroll_visible=False)
        # For the next launch, on the store thread meanwhile (its commit waits for the
        # disk: tens of ms that the restore need not wait for).
        remembered = asyncio.ensure_future(self.on_store(self.service.remember_open, session_id))
        # Resume before Enter: the restore starts as soon as the session is drawn (not
        # together with the drawing: both would share the interpreter's lock).
        await self._painted()
        await self._make_hot(session_id, started=started)
        await remembered
        await self.conversation.fill()

    async def _painted(self) -> None:
        """Wait until the screen has been drawn with what is mounted now."""
        drawn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.call_after_refresh(lambda: drawn.done() or drawn.set_result(None))
        await drawn

    async def show_latest(self, focus_last: bool = False) -> None:
        """Show the session's latest messages again (after a jump left them out)."""
        if self.session_id is None:
            return
        await self._show_stored(self.session_id, lazy=False)
        last = self.conversation.last_view
        if focus_last and last is not None:
            last.focus()

    def _jump_to(self, message_id: int) -> None:
        view = self.conversation.find(message_id)
        if view is None:
            return
        # Anchoring keeps a short conversation at the bottom with a negative scroll offset;
        # drop both before scrolling to the hit.
        self.conversation.anchor(False)
        self.conversation.scroll_to(y=0, animate=False, force=True, immediate=True)
        self.conversation.scroll_to_widget(view, animate=False, top=True, immediate=True)
        self.set_focus(view, scroll_visible=False)  # now, not after a refresh: one frame
        view.add_class("-hit")
        self.set_timer(4, lambda: view.remove_class("-hit"))


def _open_service(app: KvchatApp) -> None:
    """Runs on the engine thread: importing kvchat.service.chat loads llama.cpp's bindings.

    Set here, not by the awaiting worker, so a quit during start still closes it.
    """
    from kvchat.service.chat import ChatService

    app.service = ChatService(app.settings)
