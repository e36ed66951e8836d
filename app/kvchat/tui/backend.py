"""What the app's screens share: the conversation service and the two threads that run it.

Every call that touches the model goes to the engine thread; store reads and store-only
writes go to the store thread. The UI thread only awaits their results. The service itself
is opened on the engine thread after the first frame (importing it loads llama.cpp); until
it is, the first page of sessions and the open session's last page are read through a
store-only :class:`~kvchat.service.session_index.SessionIndex` (no llama.cpp, no numpy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.tui.threads import SerialThread

if TYPE_CHECKING:
    # Imported lazily at run time: pydantic and llama.cpp are not needed for the first frame.
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from kvchat.service.session_index import SessionIndex, SessionReads

T = TypeVar("T")


class Backend:
    """The service (``None`` until opened), its engine and store threads, and the count of
    the user's actions queued on the engine thread (housekeeping yields to them)."""

    def __init__(self, settings: Settings | None = None, service: ChatService | None = None):
        self._settings = settings
        self.service = service
        # The store-only reads of the first paint, until the service is open (then closed).
        self.index: SessionIndex | None = None
        self.engine_thread = SerialThread("engine")
        self.store_thread = SerialThread("store")
        # The app is quitting: background work ends quietly.
        self.closing = False
        # Failures of background work, shown as notices (tests assert it stays empty).
        self.worker_errors: list[BaseException] = []
        # When the model was loaded and the app became usable (perf_counter).
        self.ready_at: float | None = None
        # User actions queued on the engine thread so far / not finished yet: housekeeping
        # runs only when none is in flight, and not once a later one was queued.
        self.engine_actions = 0
        self.engine_jobs = 0
        # Opening the index (importing the store, opening the database) starts with the app,
        # while Textual starts on the UI thread: the first paint waits for the later of the
        # two, not for both one after the other.
        self._index_opening: Future[None] | None = (
            self.store_thread.submit(self.open_index) if service is None else None
        )

    @property
    def settings(self) -> Settings:
        """The settings given, else the environment's and config file's, read on first use
        (after the first frame: pydantic is slow to import)."""
        if self._settings is None:
            from kvchat.config import Settings

            self._settings = Settings()
        return self._settings

    @property
    def model_label(self) -> str:
        """What the status line names while the engine starts."""
        if self.settings.engine == "openai" and self.settings.openai_url:
            return f"at {self.settings.openai_url}"
        if self.settings.engine == "llama-server" and self.settings.server_url:
            return f"at {self.settings.server_url}"
        if self.settings.model:
            return Path(self.settings.model).name
        return "SmolLM2-135M (bundled)"

    @property
    def chat(self) -> ChatService:
        """The service, once opened (every caller runs after the start-up opened it)."""
        service = self.service
        assert service is not None
        return service

    @property
    def reader(self) -> SessionReads:
        """What reads of sessions and messages go through: the service once it is open,
        else the store-only index opened for the first paint."""
        if self.service is not None:
            return self.service.reader
        index = self.index
        assert index is not None
        return index.reader

    async def index_opened(self) -> None:
        """Wait for the store-only index that the app's construction began opening (a
        KvchatError if the database cannot be opened)."""
        if self._index_opening is not None:
            await asyncio.wrap_future(self._index_opening)

    def open_index(self) -> None:
        """On the store thread: open the database for reading the session list and messages
        without the engine (the first paint need not wait for llama.cpp's import)."""
        from kvchat.paths import data_dir
        from kvchat.service.session_index import SessionIndex

        self.index = SessionIndex(data_dir() / "kvchat.db")

    def close_index(self) -> None:
        """On the store thread (after every read queued through it): the service reads now."""
        index, self.index = self.index, None
        if index is not None:
            index.close()

    def open_service(self) -> None:
        """On the engine thread: importing kvchat.service.chat loads llama.cpp's bindings.

        Set here, not by the awaiting worker, so a quit during start still closes it.
        """
        from kvchat.service.chat import ChatService

        self.service = ChatService(self.settings)

    def load_model(self) -> tuple[str, int, str | None]:
        """On the engine thread: load the model; what the status bar shows of it (its name,
        context length and the plan's note)."""
        service = self.chat
        # A turn returns once its reply is stored; the app runs the settle and the snapshot
        # write while idle, and a new message makes them yield (see IdleWork).
        service.upkeep.deferred = True
        engine = service.load_engine()
        # Named as the user found it: a store's model by its store name, not its blob's.
        name = service.models.loaded_name or engine.config.model_path.stem
        return name, engine.n_ctx, service.host.plan_note

    def switch_model(self, path: str) -> tuple[str, int, str | None]:
        """On the engine thread: switch to the model file ``path``, then as :meth:`load_model`."""
        self.chat.models.switch_model(path)
        return self.load_model()

    def on_engine(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread (anything touching the model); await the result.

        Every call is a user's action: housekeeping running or queued ahead of it (the
        settle and the snapshot write after a reply) yields first, so the action starts
        at once; as the action's work starts, housekeeping is allowed again.
        """
        if self.service is not None:
            self.service.upkeep.interrupt()
        self.engine_actions += 1
        self.engine_jobs += 1
        future = self.engine_thread.run(self._user_job, fn, *args, **kwargs)
        future.add_done_callback(self._engine_job_done)
        return future

    def _user_job(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """On the engine thread: a user's action starts; housekeeping may run again after it."""
        if self.service is not None:
            self.service.upkeep.allow()
        return fn(*args, **kwargs)

    def _engine_job_done(self, _future: object) -> None:
        self.engine_jobs -= 1

    def on_store(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run ``fn`` on the store thread (reads and store-only writes); await the result."""
        return self.store_thread.run(fn, *args, **kwargs)
