"""The conversation service: one turn = store + engine + kvcache. It knows no UI.

The service composes the store (text, the source of truth), an engine from the factory
(loaded lazily) and the KV tiers; the UI and CLI talk to it alone. Not thread-safe: a UI
runs every call that touches the engine on one worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvchat.config import Settings, data_dir
from kvchat.crashes import unreported_crash
from kvchat.engine import CancelCheck, Engine, create_engine, engine_config
from kvchat.engine.probe import ProbeOutcome, probed_config
from kvchat.errors import KvchatError
from kvchat.kvcache import Fingerprint, RestoreResult
from kvchat.kvcache.server_tiers import ServerSlots
from kvchat.kvcache.tiers import CacheGc, KVTiers
from kvchat.planner.defaults import DefaultsChoice, plan_defaults, retry_plan
from kvchat.service.book import DEFAULT_TITLE, SessionBook
from kvchat.service.checks import check_engine_config, disk_full, os_error_line
from kvchat.service.context_window import fit_window, system_head
from kvchat.service.model_choices import ModelChoices
from kvchat.service.pipeline import TurnRunner
from kvchat.service.reply_turns import ReplyTurns
from kvchat.service.reports import (
    SESSION_SETTINGS,
    Housekeeping,
    SnapshotWrite,
    TokenCallback,
    TokenCounts,
    TurnReport,
    UnansweredMessage,
    WindowShift,
    generation_params,
)
from kvchat.service.upkeep import ContextUpkeep
from kvchat.store import Message, SearchHit, Session, SessionSummary, Store
from kvchat.store.locks import SessionLocks
from kvchat.store.store import DamagedDatabase, StoreFull
from kvchat.text import check_text, short_title

__all__ = [
    "CacheGc",
    "disk_full",
    "ChatService",
    "Housekeeping",
    "Message",
    "RestoreResult",
    "SearchHit",
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
# How long a turn waits for another process's turn on the same session before giving up.
LOCK_WAIT_S = 3.0


class ChatService(TurnRunner, ReplyTurns, ContextUpkeep, SessionBook, ModelChoices):
    """Sessions and turns over one store, the KV tiers and one (lazily loaded) engine."""

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
        self.settings = settings
        directory = home or data_dir()
        self._directory = directory
        try:
            self.store = Store(directory / "kvchat.db")
        except OSError as exc:
            raise KvchatError(os_error_line("cannot open the database", exc)) from None
        except (StoreFull, DamagedDatabase):
            raise
        except KvchatError as exc:
            # SQLite reports a disk with no room for its shared-memory file as an I/O error.
            if disk_full(directory):
                raise StoreFull(f"the disk is full: cannot open the database ({exc})") from None
            raise
        try:
            # The KV tiers (hot context, RAM, disk); tools that measure them use this directly.
            self.tiers = KVTiers.open(directory / "snapshots", self.store, settings)
        except BaseException:
            self.store.close()
            raise
        # One turn per session at a time, across processes (see SessionLocks).
        self.locks = SessionLocks(directory / "locks")
        self.stream_save_every_s = STREAM_SAVE_EVERY_S
        self._init_upkeep()
        self._engine: Engine | None = None
        self._given_engine = engine
        self._fingerprint: Fingerprint | None = None
        # n_ctx, KV types, flash attention and GPU layers as planned (see load_engine).
        self.plan: DefaultsChoice | None = None
        # What the engine probe chose for this machine (None: nothing probed, see load_engine).
        self.probe: ProbeOutcome | None = None

    # --- engine ---------------------------------------------------------------------------

    def load_engine(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        if self._engine is None:
            path = self.settings.model_path()
            self.plan = plan_defaults(self.settings, path)
            planned = self.plan.apply(self.settings)
            if self._given_engine is not None:
                engine = self._given_engine
                check_engine_config(
                    engine, engine_config(planned, path), self.settings.model_fields_set
                )
                engine.clear()  # another service's KV is not this one's
            else:
                engine = self._open_engine(planned, path)
            self._engine = engine
            if engine.capabilities.server_slots:  # a llama-server keeps the KV (issue 13)
                self.tiers = ServerSlots(self.store, engine)  # type: ignore[assignment,arg-type]
                return engine
            self._fingerprint = Fingerprint.current(path, engine.layout())
            self.tiers.attach(engine, self._fingerprint)
        return self._engine

    def _open_engine(self, planned: Settings, path: Path) -> Engine:
        """Open the engine on the settings the probe found safe and fast on this machine;
        a GPU that fails to load it gets smaller plans (fewer layers, less context)."""
        config = engine_config(planned, path)
        if planned.engine == "llama.cpp":
            config, self.probe = probed_config(
                config,
                repack=planned.repack,
                threads=planned.n_threads is None,
                directory=self._directory,
            )
        tried: list[str] = []
        while True:
            try:
                return create_engine(planned, path, config=config)
            except KvchatError as exc:
                assert self.plan is not None
                smaller = retry_plan(self.plan, config, str(exc))
                if smaller is None:
                    if tried:
                        raise KvchatError(f"{exc} (after: {'; '.join(tried)})") from exc
                    raise
                tried.append(smaller.retry_note)
                self.plan = smaller
                config = replace(config, n_ctx=smaller.n_ctx, n_gpu_layers=smaller.n_gpu_layers)

    def startup_notices(self) -> list[str]:
        """Lines to say once when the model has loaded: the probe's choice the first time
        it was made, and a crash of the last run not reported yet."""
        notices = []
        if self.probe is not None and self.probe.fresh and self.probe.reason:
            notices.append(self.probe.reason)
        crash = unreported_crash(self._directory)
        if crash is not None:
            notices.append(crash.line())
        return notices

    @property
    def engine(self) -> Engine:
        """The engine, loaded on first use (for tests and tools; a UI needs only the members
        below: context_tokens, plan_note)."""
        return self.load_engine()

    @property
    def context_tokens(self) -> int:
        """Tokens in the live context (0 before the model loads)."""
        return self._engine.n_tokens if self._engine is not None else 0

    @property
    def plan_note(self) -> str | None:
        """The context settings chosen for this machine, one line (None before the model loads)."""
        if isinstance(self.tiers, ServerSlots):  # the model runs in a llama-server
            return self.tiers.note
        if self.plan is None:
            return None
        notes = [self.plan.note]
        engine = self._engine
        if self.probe is not None and engine is not None and self.probe.best_threads("generate"):
            config = engine.config
            if config.n_threads != self.probe.best_threads("generate"):
                notes.append(
                    f"threads re-measured after a slow reply: now {config.n_threads} for "
                    f"generation, {config.n_threads_batch} for prompts"
                )
        return " — ".join(notes)

    @property
    def fingerprint(self) -> Fingerprint:
        self.load_engine()
        assert self._fingerprint is not None
        return self._fingerprint

    def close(self) -> None:
        """Save the hot session if it has unsaved KV, then release everything (an engine
        given to the constructor is left open for its owner)."""
        self._release_engine()
        self.store.close()

    def _release_engine(self) -> None:
        """Save the hot session if it has unsaved KV, then close the engine (also before
        another model loads: see switch_model)."""
        if self._engine is not None:
            self._abandon_upkeep()
            self.tiers.detach()
            if self._engine is not self._given_engine:
                self._engine.close()
            self._engine = None

    # --- the KV cache ------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, Any]:
        """Both tiers and the persistent counters, for ``kvchat cache`` and the app."""
        return self._kv().stats()

    def cache_gc(self) -> CacheGc:
        """Remove orphaned files and unused chunks, evict snapshots beyond the disk budget."""
        return self._kv().gc(self.locks)  # a session with a turn running is not evicted

    def cache_clear(self, session_id: str | None = None) -> int:
        """Delete the saved KV of one session, or of all; returns snapshots deleted. Text is kept."""
        return self._kv().clear(session_id)

    def _kv(self) -> KVTiers:
        """The tiers; a llama-server's slot files are known once the engine is open."""
        if self.settings.engine == "llama-server":
            self.load_engine()
        return self.tiers

    def make_hot(
        self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it.

        Hot → RAM → disk (its own snapshot, or the longest prefix another session's
        snapshot shares with ``prompt``, by default its whole history) → none.
        """
        self.load_engine()
        self._abandon_upkeep()  # the last turn's housekeeping yields to this
        return self.tiers.make_hot(
            session_id,
            no_restore=no_restore,
            prompt=prompt,
            history=lambda: self._history_tokens(session_id),
        )

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
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        text = self._checked_message(text, session.system_prompt, params.max_tokens)
        with self._turn_lock(session_id):
            engine = self.load_engine()
            self.store.add_message(session_id, "user", text, token_count=engine.count_tokens(text))
            try:
                if session.title == DEFAULT_TITLE:
                    self._retitle(session_id, short_title(text))
                return self._turn(session_id, params, on_token, cancel, no_restore)
            except KvchatError as exc:
                raise UnansweredMessage(session_id, str(exc)) from exc

    def start(
        self,
        text: str,
        *,
        system_prompt: str | None = None,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """A new session whose first turn is ``text`` (``kvchat ask`` without ``--session``).

        The session exists only if it got a reply: when the turn fails, or the model says
        nothing, the new session is deleted again (a KvchatError says so), so no empty
        session or lone question is left behind.
        """
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        params = generation_params(self.settings, {}, overrides)
        text = self._checked_message(text, system_prompt, params.max_tokens)
        session = self.new_session(system_prompt=system_prompt)
        try:
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
            self.delete(session_id)
        except (KvchatError, OSError):
            pass

    def _checked_message(self, text: str, system_prompt: str | None, max_tokens: int) -> str:
        """The message stripped, if it is text, not empty, and fits the context alone."""
        text = check_text(text).strip()
        if not text:
            raise KvchatError("the message is empty")
        engine = self.load_engine()
        head = system_head(system_prompt or self.settings.system_prompt)
        reserve = min(max_tokens, engine.n_ctx // 4)
        fit_window(
            engine.chat_tokens, head, [{"role": "user", "content": text}], engine.n_ctx, reserve
        )
        return text

    def _retitle(self, session_id: str, title: str) -> None:
        try:
            self.store.update_session(session_id, title=title)
        except StoreFull:
            pass  # a title is a convenience: the turn goes on

    @contextmanager
    def _turn_lock(self, session_id: str) -> Iterator[None]:
        """Hold the session's turn lock (see :class:`kvchat.store.locks.SessionLocks`)."""
        try:
            held = self.locks.hold(session_id, LOCK_WAIT_S)
            held.__enter__()
        except OSError as exc:
            raise KvchatError(os_error_line(f"cannot lock session {session_id}", exc)) from None
        try:
            yield
        finally:
            held.__exit__(None, None, None)

    def _system_head(self, session: Session) -> list[dict[str, str]]:
        return system_head(session.system_prompt or self.settings.system_prompt)


@contextmanager
def open_service(settings: Settings, home: Path | None = None) -> Iterator[ChatService]:
    """A service that is closed (the hot session saved) however the block ends."""
    service = ChatService(settings, home=home)
    try:
        yield service
    finally:
        service.close()
