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
* :class:`~kvchat.service.model_choices.ModelChoices`: the model picker.

Not thread-safe: a UI runs every call that touches the engine on one worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from kvchat.config import Settings
from kvchat.engine import CancelCheck, Engine
from kvchat.engine.probe import ProbeOutcome
from kvchat.errors import KvchatError
from kvchat.kvcache import Fingerprint, RestoreResult
from kvchat.kvcache.tiers import CacheGc, KVTiers, SnapshotWrite, Tiers
from kvchat.paths import data_dir
from kvchat.planner.defaults import DefaultsChoice
from kvchat.service.book import SessionBook
from kvchat.service.checks import open_store
from kvchat.service.engine_host import EngineHost
from kvchat.service.exports import ExportFormat
from kvchat.service.model_choices import ModelChoice, ModelChoices, SessionModel
from kvchat.service.pipeline import POST_WAIT_S, PrefillProgress, TurnOptions, TurnPipeline
from kvchat.service.reasoning import ReasoningStyle, ThinkingSwitch
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
from kvchat.service.streaming import SaveTrouble
from kvchat.service.upkeep import Upkeep
from kvchat.store import (
    Message,
    MessageWindow,
    SearchHit,
    Session,
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

# A streaming reply is stored (partial) after this long, then updated this often.
STREAM_SAVE_EVERY_S = 1.0


class ChatService(SessionReader):
    """Sessions and turns over one store, the KV tiers and one (lazily loaded) engine (the
    session list and a session's pages: :class:`SessionReader`'s reads)."""

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
        self.upkeep = Upkeep(self.host, self.store, self.locks)
        self.models = ModelChoices(self.host, self.store, self.upkeep)
        self.turns = TurnPipeline(
            self.host, self.store, self.locks, self.sessions, self.upkeep, self.models
        )
        self.turns.stream_save_every_s = STREAM_SAVE_EVERY_S

    # --- what the parts hold ------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """The settings in use (a model switch replaces them)."""
        return self.host.settings

    @property
    def tiers(self) -> Tiers:
        """Where sessions' KV lives: the local tiers, or a llama-server's slots."""
        return self.host.tiers

    @property
    def local_tiers(self) -> KVTiers:
        """The context, RAM and disk tiers (the benchmark measures them directly)."""
        return self.host.local_tiers

    @property
    def plan(self) -> DefaultsChoice | None:
        """n_ctx, KV types, flash attention and GPU layers as planned (None before loading)."""
        return self.host.plan

    @property
    def probe(self) -> ProbeOutcome | None:
        """What the engine probe chose for this machine (None: nothing probed)."""
        return self.host.probe

    @property
    def stream_save_every_s(self) -> float:
        return self.turns.stream_save_every_s

    @stream_save_every_s.setter
    def stream_save_every_s(self, seconds: float) -> None:
        self.turns.stream_save_every_s = seconds

    @property
    def prefill_progress(self) -> PrefillProgress | None:
        """A hook called between a prompt's prefill batches (see TurnPipeline)."""
        return self.turns.prefill_progress

    @prefill_progress.setter
    def prefill_progress(self, hook: PrefillProgress | None) -> None:
        self.turns.prefill_progress = hook

    @property
    def save_trouble(self) -> SaveTrouble | None:
        """A hook told that a streaming reply is not being saved, one line (None: it is
        again); called on the thread running the turn (see StreamSaver)."""
        return self.turns.save_trouble

    @save_trouble.setter
    def save_trouble(self, hook: SaveTrouble | None) -> None:
        self.turns.save_trouble = hook

    @property
    def defer_housekeeping(self) -> bool:
        """Whether a turn leaves its settle and snapshot write to :meth:`housekeep`."""
        return self.upkeep.deferred

    @defer_housekeeping.setter
    def defer_housekeeping(self, deferred: bool) -> None:
        self.upkeep.deferred = deferred

    # --- the engine ---------------------------------------------------------------------------

    def load_engine(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        return self.host.load()

    @property
    def engine(self) -> Engine:
        """The engine, loaded on first use (for tests and tools; a UI needs only the members
        below: context_tokens, plan_note)."""
        return self.host.load()

    @property
    def context_tokens(self) -> int:
        """Tokens in the live context (0 before the model loads)."""
        loaded = self.host.loaded
        engine = loaded.token_level() if loaded is not None else None
        return engine.n_tokens if engine is not None else 0

    @property
    def plan_note(self) -> str | None:
        """The context settings chosen for this machine, one line (None before loading)."""
        return self.host.plan_note

    @property
    def fingerprint(self) -> Fingerprint:
        return self.host.fingerprint

    def startup_notices(self) -> list[str]:
        """Lines to say once when the model has loaded (see EngineHost.startup_notices)."""
        return self.host.startup_notices()

    def close(self) -> None:
        """Save the hot session if it has unsaved KV, then release everything (an engine
        given to the constructor is left open for its owner)."""
        self.upkeep.abandon()
        self.host.release()
        self.store.close()

    # --- the KV cache -------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, Any]:
        """Both tiers and the persistent counters, for ``kvchat cache`` and the app."""
        return self.host.kv().stats()

    def cache_gc(self) -> CacheGc:
        """Remove orphaned files and unused chunks, evict snapshots beyond the disk budget."""
        return self.host.kv().gc(self.locks)  # a session with a turn running is not evicted

    def cache_clear(self, session_id: str | None = None) -> int:
        """Delete the saved KV of one session, or of all; returns snapshots deleted. Text is kept."""
        return self.host.kv().clear(session_id)

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
        **overrides: Any,
    ) -> TurnReport:
        """Commit the user's message, then run the model and commit its reply.

        Nothing is stored when the message is empty, not valid text, or cannot fit the
        context. The session's turn lock is held from storing the message to saving the
        snapshot (another process's turn on it raises ``SessionBusy`` after a short wait).
        Once the message is stored it stays: if the turn then fails, the error says that
        the message is saved without a reply. A reply that was generated is always in the
        report; if it could not be stored, ``report.reply_error`` says why.
        """
        options = TurnOptions(on_token, cancel, no_restore)
        return self.turns.send(session_id, text, options, overrides)

    def start(
        self,
        text: str,
        *,
        system_prompt: str | None = None,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        think: bool | None = None,
        **overrides: Any,
    ) -> TurnReport:
        """A new session whose first turn is ``text`` (``kvchat ask`` without ``--session``);
        ``think``: the session's thinking switch (None: the model's default).

        The session exists only if it got a reply: when the turn fails, or the model says
        nothing, the new session is deleted again (a KvchatError says so), so no empty
        session or lone question is left behind.
        """
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        params = generation_params(self.settings, {}, overrides)
        text = self.turns.checked_message(text, system_prompt, params.max_tokens)
        session = self.sessions.new_session(system_prompt=system_prompt)
        try:
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

    def post(self, session_id: str, text: str, *, wait_s: float = POST_WAIT_S) -> Message:
        """Commit the user's message now, without the model (see TurnPipeline.post)."""
        return self.turns.post(session_id, text, wait_s=wait_s)

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

    def probe_turn(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (``kvchat bench``)."""
        return self.turns.probe(session_id, text, no_restore=no_restore)

    # --- after a turn -------------------------------------------------------------------------

    def interrupt_housekeeping(self) -> None:
        """A new message waits: housekeeping stops at its next batch (any thread)."""
        self.upkeep.interrupt()

    def allow_housekeeping(self) -> None:
        """Housekeeping may run again (a UI calls it as each user action's work starts)."""
        self.upkeep.allow()

    @property
    def housekeeping_pending(self) -> bool:
        """Whether the last turn's settle or snapshot write has not run (or not finished)."""
        return self.upkeep.pending

    def housekeep(self) -> Housekeeping:
        """Run what the last turn left pending (see Upkeep.run_pending)."""
        return self.upkeep.run_pending()

    # --- sessions -----------------------------------------------------------------------------

    def new_session(self, title: str | None = None, system_prompt: str | None = None) -> Session:
        return self.sessions.new_session(title, system_prompt)

    def resolve(self, ref: str) -> Session:
        """A session by id or unique title prefix."""
        return self.sessions.resolve(ref)

    def list_sessions(self) -> list[SessionSummary]:
        return self.sessions.list_sessions()

    def remember_open(self, session_id: str) -> None:
        """Note that the app opened this session: the next launch opens it again."""
        self.sessions.remember_open(session_id)

    def messages(self, session_id: str) -> list[Message]:
        return self.sessions.messages(session_id)

    def message_at(self, session_id: str, number: int) -> Message:
        """The session's message #``number`` (1-based, in order: what the app shows)."""
        return self.sessions.message_at(session_id, number)

    def changed_at(self, session_id: str) -> str:
        """When the session last changed, by any process (one row read by its key)."""
        return self.sessions.changed_at(session_id)

    def turn_holder(self, session_id: str) -> str | None:
        """Why a turn on the session would wait now, or None when it is free."""
        return self.sessions.turn_holder(session_id)

    def holding(self, session_id: str) -> AbstractContextManager[None]:
        """Hold the session's turn lock as a turn does (see SessionBook.holding)."""
        return self.sessions.holding(session_id)

    def add_message(
        self, session_id: str, role: str, text: str, *, token_count: int = 0, partial: bool = False
    ) -> Message:
        """Store a message without running the model (tests, the benchmark, an import)."""
        return self.sessions.add_message(
            session_id, role, text, token_count=token_count, partial=partial
        )

    def rename(self, session_id: str, title: str) -> Session:
        return self.sessions.rename(session_id, title)

    def configure(
        self,
        session_id: str,
        *,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        """Set a session's system prompt ("" clears it) and sampling overrides."""
        return self.sessions.configure(session_id, system_prompt=system_prompt, settings=settings)

    def delete(self, session_id: str) -> None:
        """Delete a session, its messages and its KV in every tier."""
        self.sessions.delete(session_id)

    def drop_if_unused(self, session_id: str) -> bool:
        """Delete a session that never got a message and is as it was made."""
        return self.sessions.drop_if_unused(session_id)

    def export(self, session_id: str, fmt: ExportFormat, reasoning: bool = True) -> str:
        """The session as Markdown, JSON or HTML (``reasoning`` False: without reasoning)."""
        return self.sessions.export(session_id, fmt, reasoning)

    def thinking_switch(self) -> ThinkingSwitch:
        """How the loaded model's template turns thinking on or off (loads the model)."""
        return self.host.thinking_switch

    @property
    def reasoning_style(self) -> ReasoningStyle:
        """How the loaded model's replies carry reasoning (loads the model)."""
        return self.host.reasoning_style

    def search(self, query: str) -> list[SearchHit]:
        return self.sessions.search(query)

    def fork(self, session_id: str, at_message: int | None = None) -> Session:
        """A new session with this one's messages up to ``at_message`` (KV shared)."""
        return self.sessions.fork(session_id, at_message)

    def edit(self, session_id: str, message_id: int, text: str) -> Session:
        """Edit a past user message as a new branch: the original conversation is kept."""
        return self.sessions.edit(session_id, message_id, text)

    def reply_versions(self, message_id: int) -> tuple[int, int]:
        return self.sessions.reply_versions(message_id)

    def reply_versions_in(self, session_id: str) -> dict[int, tuple[int, int]]:
        return self.sessions.reply_versions_in(session_id)

    def switch_version(self, message_id: int, step: int) -> Message | None:
        """Make the previous or next version of the last reply current."""
        return self.sessions.switch_version(message_id, step)

    # --- models -------------------------------------------------------------------------------

    def model_choices(self, also: Path | None = None) -> list[ModelChoice]:
        return self.models.model_choices(also)

    @property
    def loaded_model_path(self) -> Path | None:
        return self.host.loaded_model_path

    def switch_model(self, spec: str | Path) -> Path:
        """Load another model in place of the loaded one (see ModelChoices.switch_model)."""
        return self.models.switch_model(spec)

    def session_model(self, session_id: str) -> SessionModel | None:
        """The model ``session_id`` last ran with (None: no turn recorded one)."""
        return self.models.session_model(session_id)

    # --- the session list at scale (issue 26) -------------------------------------------------

    def sessions_changed_since(self, stamp: int) -> SessionChanges:
        """What another process (or this one) made, changed or deleted after ``stamp``."""
        return self.sessions.sessions_changed_since(stamp)


@contextmanager
def open_service(settings: Settings, home: Path | None = None) -> Iterator[ChatService]:
    """A service that is closed (the hot session saved) however the block ends."""
    service = ChatService(settings, home=home)
    try:
        yield service
    finally:
        service.close()
