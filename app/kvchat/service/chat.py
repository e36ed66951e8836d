"""The conversation service: one turn = store + engine + kvcache. It knows no UI.

:class:`ChatService` is the one door the UI and the CLI use. It owns the store (text, the
source of truth), the session locks and the KV tiers, and composes collaborators that each
own one concern:

* :class:`~kvchat.service.engine_host.EngineHost`: the model, loaded lazily, and the tiers
  its KV lives in;
* :class:`~kvchat.service.book.SessionBook`: sessions, branches, reply versions;
* :class:`~kvchat.service.pipeline.TurnPipeline`: every kind of turn;
* :class:`~kvchat.service.upkeep.Upkeep`: the settle, the snapshot write and titles after
  a turn;
* :class:`~kvchat.service.model_choices.ModelChoices`: the model picker;
* :class:`~kvchat.service.session_index.SessionReader`: the session list and a session's pages;
* :class:`~kvchat.service.imports.ImportLedger`: what an import or a bundle asks of the store;
* :class:`~kvchat.service.tools.ToolTurns`: turns whose replies call tools, and ``/tool``;
* :class:`~kvchat.service.library.DocumentLibrary`: the documents kept and read ahead;
* :class:`~kvchat.service.compaction.Compactor`: a summary read instead of old messages.

Each is a public attribute (``service.sessions.fork(...)``, ``service.upkeep.pending``): a
caller reaches the one it needs, not a forwarder. The service's own members are what it
composes: a whole turn (``send``, ``start``, ...), closing, and the engine's seam (loading,
the hot context, where a session's KV is) that a UI test's stand-in service replaces.

Not thread-safe: a UI runs every call that touches the engine on one worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvchat.config import Settings
from kvchat.engine import CancelCheck, Engine
from kvchat.errors import KvchatError
from kvchat.kvcache import RestoreResult
from kvchat.kvcache.tiers import CacheGc, KVTiers, SnapshotWrite
from kvchat.paths import data_dir
from kvchat.service.book import SessionBook
from kvchat.service.checks import open_store
from kvchat.service.compaction import Compactor
from kvchat.service.documents import DocumentShelf, ReadDocuments
from kvchat.service.engine_host import EngineHost
from kvchat.service.imports import ImportLedger
from kvchat.service.library import DocumentLibrary
from kvchat.service.model_choices import ModelChoices
from kvchat.service.pipeline import TurnOptions, TurnPipeline
from kvchat.service.reports import (
    SESSION_SETTINGS,
    Housekeeping,
    TokenCallback,
    TokenCounts,
    TurnReport,
    UnansweredMessage,
    WindowShift,
    generation_params,
)
from kvchat.service.session_index import SessionReader
from kvchat.service.streaming import STREAM_SAVE_EVERY_S as STREAMING_SAVE_EVERY_S
from kvchat.service.tools import ToolTurns
from kvchat.service.upkeep import Upkeep
from kvchat.store import (
    Message,
    MessageWindow,
    SearchHit,
    SessionChanges,
    SessionPage,
    SessionSummary,
)
from kvchat.store.locks import SessionLocks
from kvchat.text import check_text

__all__ = [
    "CacheGc",
    "ChatService",
    "Housekeeping",
    "Message",
    "MessageWindow",
    "RestoreResult",
    "SearchHit",
    "SessionChanges",
    "SessionPage",
    "SessionSummary",
    "open_service",
    "SESSION_SETTINGS",
    "SnapshotWrite",
    "TokenCallback",
    "TokenCounts",
    "TurnReport",
    "UnansweredMessage",
    "WindowShift",
]

# A streaming reply is stored (partial) after this long, then updated this often (tests
# set it here; the value is streaming's).
STREAM_SAVE_EVERY_S = STREAMING_SAVE_EVERY_S


class ChatService:
    """Sessions and turns over one store, the KV tiers and one (lazily loaded) engine, each
    concern held by a collaborator (see the module's docstring)."""

    def __init__(
        self, settings: Settings, home: Path | None = None, *, engine: Engine | None = None
    ) -> None:
        """``home`` overrides the data directory (the benchmark uses a scratch one).

        ``engine``: an engine already loaded (by a test suite, to load a model once for many
        services) to use instead of creating one. It must be on the settings' model file and
        have every context setting they set explicitly (n_ctx, KV types, ...; a ValueError
        when it is first used otherwise); its context is emptied then, and :meth:`close`
        leaves it open: whoever created it closes it.
        """
        directory = home or data_dir()
        self.store = open_store(directory / "kvchat.db")
        try:
            tiers = KVTiers.open(directory / "snapshots", self.store, settings)
        except BaseException:
            self.store.close()
            raise
        # One turn per session at a time, across processes (see SessionLocks).
        self.locks = SessionLocks(directory / "locks")
        self.host = EngineHost(settings, directory, self.store, tiers, engine)
        self.sessions = SessionBook(self.store, self.locks, self.host)
        self.documents = DocumentShelf(self.store)
        self.upkeep = Upkeep(self.host, self.store, self.locks, self.documents)
        self.models = ModelChoices(self.host, self.store, self.upkeep)
        self.turns = TurnPipeline(
            self.host,
            self.store,
            self.locks,
            self.sessions,
            self.upkeep,
            self.models,
            self.documents,
        )
        self.turns.stream_save_every_s = STREAM_SAVE_EVERY_S
        self.tools = ToolTurns(self.host, self.store, self.locks, self.turns, self.upkeep)
        self.compaction = Compactor(self.turns, self.sessions)
        self.reader = SessionReader(self.store)
        self.imports = ImportLedger(self.store)
        self.library = DocumentLibrary(self.host, self.store, self.documents, self.turns.make_hot)

    # --- the engine: the seam a UI test's stand-in service replaces ---------------------------

    def load_engine(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        return self.host.load()

    @property
    def engine(self) -> Engine:
        """The engine, loaded on first use (for tests and tools; a UI needs only the members
        below: context_tokens, host.plan_note)."""
        return self.host.load()

    @property
    def context_tokens(self) -> int:
        """Tokens in the live context (0 before the model loads)."""
        loaded = self.host.loaded
        engine = loaded.token_level() if loaded is not None else None
        return engine.n_tokens if engine is not None else 0

    def close(self) -> None:
        """Save the hot session if it has unsaved KV, then release everything (an engine
        given to the constructor is left open for its owner); the tool servers stop."""
        self.tools.close()
        self.upkeep.abandon()
        self.host.release()
        self.store.close()

    # --- the KV cache -------------------------------------------------------------------------

    def cache_gc(self) -> CacheGc:
        """Remove orphaned files and unused chunks, evict snapshots beyond the disk budget."""
        return self.host.kv().gc(self.locks)  # a session with a turn running is not evicted

    def make_hot(
        self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it."""
        return self.turns.make_hot(session_id, no_restore=no_restore, prompt=prompt)

    def kv_location(self, session_id: str) -> str:
        """Where this session's KV lives now: hot, ram, disk or none."""
        return self.sessions.kv_location(session_id)

    # --- turns ----------------------------------------------------------------------------

    def send(
        self,
        session_id: str,
        text: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        documents: ReadDocuments | None = None,
        **overrides: Any,
    ) -> TurnReport:
        """Commit the user's message, then run the model and commit its reply.

        ``documents`` (read by :meth:`DocumentShelf.read`) come with this message: their
        text goes before it, read once for this conversation.

        Nothing is stored when the message is empty, not valid text, or cannot fit the
        context. The session's turn lock is held from storing the message to saving the
        snapshot (another process's turn on it raises ``SessionBusy`` after a short wait).
        Once the message is stored it stays: if the turn then fails, the error says that
        the message is saved without a reply. A reply that was generated is always in the
        report; if it could not be stored, ``report.reply_error`` says why.
        """
        options = TurnOptions(on_token, cancel, no_restore)
        return self.turns.send(session_id, text, options, overrides, documents)

    def start(
        self,
        text: str,
        *,
        system_prompt: str | None = None,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        think: bool | None = None,
        documents: ReadDocuments | None = None,
        **overrides: Any,
    ) -> TurnReport:
        """A new session whose first turn is ``text`` (``kvchat ask`` without ``--session``);
        ``think``: the session's thinking switch (None: the model's default); ``documents``:
        what the conversation is about, placed after the system prompt (read once for every
        conversation started with the same system prompt and documents).

        The session exists only if it got a reply: when the turn fails, or the model says
        nothing, the new session is deleted again (a KvchatError says so), so no empty
        session or lone question is left behind.
        """
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        params = generation_params(self.host.settings, {}, overrides)
        text = self.turns.checked_message(text, system_prompt, params.max_tokens)
        if documents is not None:
            self.turns.check_documents(documents, system_prompt, params.max_tokens)
        session = self.sessions.new_session(system_prompt=system_prompt)
        try:
            if documents is not None:
                self.documents.give(session.id, documents)
            if think is not None:
                self.sessions.configure(session.id, settings={"think": think})
            report = self.send(
                session.id,
                text,
                on_token=on_token,
                cancel=cancel,
                no_restore=no_restore,
                **overrides,
            )
        except BaseException as exc:
            self._discard(session.id)
            if isinstance(exc, KvchatError):
                reason = exc.reason if isinstance(exc, UnansweredMessage) else str(exc)
                raise KvchatError(f"{reason}; nothing was saved") from exc
            raise
        if report.message_id is None and report.reply_error is None:
            self._discard(session.id)
            raise KvchatError("the model gave no reply; nothing was saved")
        return report

    def _discard(self, session_id: str) -> None:
        """Delete a session this service just made (best effort: a full disk may refuse)."""
        try:
            self.sessions.delete(session_id)
        except (KvchatError, OSError):
            pass

    def answer(
        self,
        session_id: str,
        message_id: int,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Run the turn on the message :meth:`post` stored (see TurnPipeline.answer)."""
        options = TurnOptions(on_token, cancel, no_restore)
        return self.turns.answer(session_id, message_id, options, overrides)

    def regenerate(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """A new version of the last reply; the earlier versions are kept."""
        options = TurnOptions(on_token, cancel, no_restore)
        return self.turns.regenerate(session_id, options, overrides)

    def continue_reply(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Go on with the last reply (one cut at the token limit)."""
        options = TurnOptions(on_token, cancel, no_restore)
        return self.turns.continue_reply(session_id, options, overrides)


@contextmanager
def open_service(settings: Settings, home: Path | None = None) -> Iterator[ChatService]:
    """A service that is closed (the hot session saved) however the block ends."""
    service = ChatService(settings, home=home)
    try:
        yield service
    finally:
        service.close()
