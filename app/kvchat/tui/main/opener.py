"""Opening sessions on the main screen: start-up, switching, resume before Enter.

At start-up the sessions list and the open session's last page are drawn from the
store-only index before the service (llama.cpp) is even imported; the service then opens
on the engine thread and the reads switch to it, nothing drawn again. A session is drawn
first (only the messages that fill the screen), then its KV is brought back on the engine
thread at once, before the user types: the first message after a
switch or a relaunch then decodes only itself. The session the app has open is
remembered, so a relaunch reopens it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.tui.backend import Backend
from kvchat.tui.main.context import RESTORE_DRAFT, ScreenContext
from kvchat.tui.main.drafts import Drafts
from kvchat.tui.main.signals import Fatal, SessionHot, SessionsChanged
from kvchat.tui.phrases import restore_phrase
from kvchat.tui.widgets.conversation import (
    BEFORE_HIT,
    HIT_WINDOW,
    SHOWN,
    MessageView,
)

if TYPE_CHECKING:
    from kvchat.service.chat import Message, MessageWindow, RestoreResult

READY_PLACEHOLDER = "Message (Enter sends · Ctrl+J new line · F1 keys)"
# The setting that makes opening a session load the model it was made with.
FOLLOW_SETTING = "open_with_session_model"
LOADING_PLACEHOLDER = "Loading the model… (you can type already)"


class StorePages:
    """A shown session's other messages, a page at a time from the store thread (the
    conversation's :class:`~kvchat.tui.widgets.conversation.MessagePages`)."""

    def __init__(self, backend: Backend, session_id: str) -> None:
        self.backend = backend
        self.session_id = session_id

    async def before(self, message_id: int, limit: int) -> list[Message]:
        reader = self.backend.reader
        return await self.backend.on_store(
            reader.messages_page, self.session_id, limit, before=message_id
        )

    async def opening(self, limit: int) -> tuple[list[Message], int]:
        reader = self.backend.reader
        window = await self.backend.on_store(
            reader.message_window, self.session_id, limit, from_start=True
        )
        return window.messages, window.total


class SessionOpener:
    """Start-up, opening a session and making it hot; it owns ``state.session_id``,
    ``shown_id``, ``hot_id``, ``seen_change`` and ``ready`` (others reset them)."""

    def __init__(self, ctx: ScreenContext) -> None:
        self.ctx = ctx
        self.drafts = Drafts(ctx)  # the input's text, kept per session
        # Set by the model switch: loads the model a session being opened was made with
        # (True: it did, and made the session hot); None: the loaded model stays.
        self.follow_model: Callable[[str], Awaitable[bool]] | None = None

    # --- start ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Show the session open at the last quit (read without the engine), open the
        service, load the model."""
        try:
            await self._start()
        finally:
            self.ctx.state.painted.set()  # a start that failed shows an error screen

    async def _start(self) -> None:
        backend, state = self.ctx.backend, self.ctx.state
        if backend.service is None:
            try:
                await backend.index_opened()
            except KvchatError as exc:
                self.ctx.post(Fatal("kvchat cannot open its data", str(exc)))
                return
        # The session the user was in when the app last quit (not the last one a CLI
        # `ask` or a fork touched).
        last = await backend.on_store(backend.reader.last_open_session)
        if last is not None:
            state.session_id = last.id
        # The list first (a page of rows, drawn at once), then the open session's messages
        # (their Markdown takes longer to build: the list's frame does not wait for them).
        await self.ctx.refresh()
        if last is not None:
            await self._painted()
            await self.show_stored(last.id)
        else:
            await self.ctx.conversation.show([])
        await self._painted()
        state.painted.set()
        self.ctx.status.set_turn(f"loading model {backend.model_label}…", "busy")
        if backend.service is None:
            # After that frame: importing the service (llama.cpp, numpy) holds the
            # interpreter's lock in long stretches.
            try:
                await backend.on_engine(backend.open_service)
            except KvchatError as exc:
                self.ctx.post(Fatal("kvchat cannot open its data", str(exc)))
                return
            finally:
                await backend.on_store(backend.close_index)
            # A look through the service: what changed meanwhile, and where the KV is
            # (only the rows that changed are drawn again).
            await self.ctx.refresh()
        if state.session_id is not None:  # its draft, kept from the last run
            self.ctx.run(RESTORE_DRAFT, self.drafts.restore, state.session_id)
        service = backend.chat
        loading = backend.on_engine(self._engine_load, state.session_id)
        await self.ctx.conversation.fill()  # the earlier messages, while the model loads
        try:
            name, n_ctx, note, followed = await loading
        except KvchatError as exc:
            self.ctx.post(Fatal("The model could not be loaded", str(exc)))
            return
        if followed is not None:
            self.ctx.app.notify(followed, markup=False, timeout=10)
            note = f"{note} · {followed}" if note else followed
        # The last run's crash, the engine probe's choice: said once.
        for notice in await backend.on_store(service.host.startup_notices):
            self.ctx.app.notify(notice, severity="warning", timeout=20, markup=False)
        self.ctx.status.set_model(name, n_ctx)
        self.ctx.status.set_context(0)
        self.ctx.prompt.placeholder = READY_PLACEHOLDER
        self.ctx.status.set_turn(f"ready · {note}" if note else "ready")
        state.ready = True  # after the status says so: a turn begun now is never shown as loading
        backend.ready_at = time.perf_counter()
        if state.session_id is not None:
            # Resume before Enter: the reopened session's KV comes back before the first
            # message, so that message decodes only itself.
            await self.make_hot(state.session_id, note=note)

    def _engine_load(self, session_id: str | None) -> tuple[str, int, str | None, str | None]:
        """On the engine thread: load the model the reopened session was made with when it
        is here and ``open_with_session_model`` is on, else the settings' model; what the
        status bar shows of it, and the line that says the session's model was loaded (or
        why it was not)."""
        backend = self.ctx.backend
        wanted = None
        if session_id is not None and backend.settings.open_with_session_model:
            wanted = backend.chat.models.other_model(session_id)
        if wanted is None:
            return (*backend.load_model(), None)
        try:
            name, n_ctx, note = backend.switch_model(str(wanted.path))
        except KvchatError as exc:  # the settings' model is loaded instead
            return (*backend.load_model(), f"{wanted.name} not loaded: {exc}")
        return name, n_ctx, note, followed_line(name)

    async def new_session_id(self) -> str:
        """Make an empty session (remembered as open); dropped at quit if it stays empty."""
        backend = self.ctx.backend
        session = await backend.on_store(backend.chat.sessions.new_session)
        self.ctx.state.made_sessions.add(session.id)
        await backend.on_store(backend.chat.sessions.remember_open, session.id)
        return str(session.id)

    # --- making a session hot -------------------------------------------------------------

    def _engine_make_hot(self, session_id: str) -> tuple[RestoreResult, int]:
        """On the engine thread: make the session hot (a new branch borrows its shared
        prefix from another session's snapshot) and report the context's size."""
        service = self.ctx.backend.chat
        result = service.make_hot(session_id)
        return result, service.context_tokens

    async def make_hot(
        self, session_id: str, started: float | None = None, note: str | None = None
    ) -> None:
        """Bring the session's KV into the context on the engine thread, and say where it
        came from; the status line tells that the next message reads only itself. Then
        (hot already or made so) a ``SessionHot`` names the model it was made with."""
        state = self.ctx.state
        if not state.ready:
            return
        if session_id == state.hot_id:
            self.ctx.post(SessionHot(session_id))
            return
        started = time.perf_counter() if started is None else started
        self.ctx.status.set_memory("KV: restoring…", "busy")
        result, used = await self.ctx.backend.on_engine(self._engine_make_hot, session_id)
        if session_id != state.session_id:
            return
        state.hot_id = session_id
        state.last_switch_ms = (time.perf_counter() - started) * 1000
        state.last_restore = result
        self.ctx.status.set_memory(f"KV: {restore_phrase(result)}", result.source)
        self.ctx.status.set_context(used if result.source != "none" else 0)
        if result.source in ("ram", "disk") and state.turn is None:
            ready = f"KV ready: {restore_phrase(result)}; the next message reads only itself"
            self.ctx.status.set_turn(f"{ready} · {note}" if note else ready)
        self.ctx.post(SessionHot(session_id))  # names the model it was made with, if another
        self.ctx.post(SessionsChanged())

    # --- opening ----------------------------------------------------------------------------

    async def show_stored(
        self, session_id: str, highlight: int | None = None, lazy: bool = True
    ) -> None:
        """Show the session's stored messages (the latest, or a window around
        ``highlight``); note when they last changed, for the watch on other processes.
        Only what is shown is read (a page, or the window around the hit): the messages
        before it come a page at a time as the user scrolls up."""
        window = await self.ctx.backend.on_store(self._stored, session_id, highlight)
        await self.ctx.conversation.show(
            window.messages,
            around=highlight,
            lazy=lazy,
            first=window.first,
            total=window.total,
            pages=StorePages(self.ctx.backend, session_id),
        )
        last = self.ctx.conversation.last_view
        if last is not None and not self.ctx.conversation.later and last.role == "assistant":
            last.set_version(*window.last_version)
        self.ctx.state.seen_change = (session_id, window.updated)
        self.ctx.state.shown_id = session_id

    def _stored(self, session_id: str, highlight: int | None) -> MessageWindow:
        """On the store thread: the messages to show (the window around ``highlight``, else
        the latest page), where they sit, when the session last changed and the version of
        its last reply."""
        reader = self.ctx.backend.reader
        if highlight is not None:
            window = reader.message_window(
                session_id, HIT_WINDOW, around=highlight, before_hit=BEFORE_HIT
            )
            if any(m.id == highlight for m in window.messages):
                return window
        return reader.message_window(session_id, SHOWN)

    async def open(
        self, session_id: str, highlight: int | None = None, focus_prompt: bool = False
    ) -> None:
        """Show a session's messages, then make it hot on the engine thread."""
        state = self.ctx.state
        if state.turn is not None and session_id != state.session_id:
            self.ctx.app.notify("A reply is being generated: Esc stops it", severity="warning")
            self.ctx.sessions.highlight(state.session_id)
            return
        started = time.perf_counter()
        # One batch from here to the focus: no frame is drawn until the new session is
        # in place (each frame costs tens of ms on a busy machine).
        with self.ctx.app.batch_update():
            if session_id != state.session_id:
                self.ctx.status.set_turn("")
            self.drafts.leave(session_id)
            state.session_id = session_id
            self.ctx.sessions.highlight(session_id)
            shown = session_id == state.shown_id
            if not shown or (
                highlight is not None and self.ctx.conversation.find(highlight) is None
            ):
                state.shown_id = None
                # Only the messages that fill the screen are built now (or the window
                # around the hit); the rest after the restore (fill below).
                await self.show_stored(session_id, highlight)
                if highlight is not None:
                    self.jump_to(highlight)
            elif highlight is not None:
                self.jump_to(highlight)
            if highlight is not None:
                state.last_jump_ms = (time.perf_counter() - started) * 1000
            elif focus_prompt:
                # Now, not after this frame (Widget.focus waits for one): one frame for all.
                self.ctx.prompt.screen.set_focus(self.ctx.prompt, scroll_visible=False)
        # For the next launch, on the store thread meanwhile (its commit waits for the
        # disk: tens of ms that the restore need not wait for).
        # (Before the service is open, quitting remembers it.)
        service = self.ctx.backend.service
        remembered = (
            asyncio.ensure_future(
                self.ctx.backend.on_store(service.sessions.remember_open, session_id)
            )
            if service is not None
            else None
        )
        # Resume before Enter: the restore starts as soon as the session is drawn (not
        # together with the drawing: both would share the interpreter's lock).
        await self._painted()
        self.ctx.run(RESTORE_DRAFT, self.drafts.restore, session_id)
        follow = self.follow_model
        if follow is None or not await follow(session_id):  # else the switch made it hot
            await self.make_hot(session_id, started=started)
        if remembered is not None:
            await remembered
        await self.ctx.conversation.fill()

    async def _painted(self) -> None:
        """Wait until the screen has been drawn with what is mounted now."""
        drawn: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done() -> None:
            if not drawn.done():
                drawn.set_result(None)

        self.ctx.conversation.call_after_refresh(done)
        await drawn

    async def show_latest(self, focus_last: bool = False, lazy: bool = False) -> None:
        """Show the session's latest messages again (after a jump left them out); ``lazy``:
        those that fill the screen first, the rest after (see Conversation.fill)."""
        if self.ctx.state.session_id is None:
            return
        await self.show_stored(self.ctx.state.session_id, lazy=lazy)
        last = self.ctx.conversation.last_view
        if focus_last and last is not None:
            last.focus()
        if lazy:
            await self.ctx.conversation.fill()

    def jump_to(self, message_id: int) -> None:
        conversation = self.ctx.conversation
        view = conversation.find(message_id)
        if view is None:
            return
        # Anchoring keeps a short conversation at the bottom with a negative scroll offset;
        # drop both before scrolling to the hit.
        conversation.anchor(False)
        conversation.scroll_to(y=0, animate=False, force=True, immediate=True)
        conversation.scroll_to_widget(view, animate=False, top=True, immediate=True)
        view.screen.set_focus(view, scroll_visible=False)  # now, not after a refresh: one frame
        view.add_class("-hit")
        conversation.set_timer(4, lambda: view.remove_class("-hit"))

    async def stored_id(self, view: MessageView) -> int | None:
        """The store id of a shown message. A message sent in this window has none on its
        view yet: find it in the store, where the shown messages are the newest ones."""
        session_id = self.ctx.state.session_id
        if view.message_id is not None or view.streaming or session_id is None:
            return view.message_id
        views = self.ctx.conversation.views
        if view not in views:
            return None
        back = len(views) - views.index(view) + self.ctx.conversation.later
        chat = self.ctx.backend.chat
        messages = await self.ctx.backend.on_store(chat.reader.messages_page, session_id, back)
        if back > len(messages):
            return None
        message = messages[0]
        if message.role != view.role or message.content != view.text:
            return None
        view.message_id = message.id
        return view.message_id


def followed_line(name: str) -> str:
    """What is said when a session's own model was loaded for it."""
    return f"Loaded {name}, the model this session was made with ({FOLLOW_SETTING} = false keeps the loaded one)"
