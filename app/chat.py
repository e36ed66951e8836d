"""The conversation service: one turn = store + engine + kvcache. It knows no UI.

The service composes the store (text, the source of truth), an engine from the factory
(loaded lazily) and the KV tiers; the UI and CLI talk to it alone. Not thread-safe: a UI
runs every call that touches the engine on one worker thread.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvchat.config import Settings, data_dir
from kvchat.engine import (
    CancelCheck,
    Engine,
    GenerationParams,
    GenerationStats,
    create_engine,
    engine_config,
)
from kvchat.errors import KvchatError
from kvchat.kvcache import Fingerprint, RestoreResult
from kvchat.kvcache.tiers import CacheGc, KVTiers
from kvchat.planner.defaults import DefaultsChoice, plan_defaults
from kvchat.sessions import DEFAULT_TITLE, SessionBook
from kvchat.store import Message, SearchHit, Session, SessionSummary, Store
from kvchat.store.locks import SessionLocks
from kvchat.store.store import DamagedDatabase, StoreFull
from kvchat.text import check_text, one_line
from kvchat.turns import (
    SESSION_SETTINGS,
    SnapshotWrite,
    TokenCallback,
    TokenCounts,
    TurnReport,
    UnansweredMessage,
    WindowShift,
    generation_params,
)
from kvchat.window import fit_window, plan_shift, settle_target, system_head

__all__ = [
    "CacheGc",
    "ChatService",
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
# Free space below which a disk counts as full (SQLite needs a few pages to open a file).
FULL_BELOW_BYTES = 64 * 1024


class ChatService(SessionBook):
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
        try:
            self.store = Store(directory / "kvchat.db")
        except OSError as exc:
            raise KvchatError(_os_error("cannot open the database", exc)) from None
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
        self._engine: Engine | None = None
        self._given_engine = engine
        self._fingerprint: Fingerprint | None = None
        # n_ctx, KV types, flash attention and GPU layers as planned (see load_engine).
        self.plan: DefaultsChoice | None = None

    # --- engine ---------------------------------------------------------------------------

    def load_engine(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        if self._engine is None:
            path = self.settings.model_path()
            self.plan = plan_defaults(self.settings, path)
            planned = self.plan.apply(self.settings)
            if self._given_engine is not None:
                engine = self._given_engine
                _check_config(engine, engine_config(planned, path), self.settings.model_fields_set)
                engine.clear()  # another service's KV is not this one's
            else:
                engine = create_engine(planned, path)
            self._engine = engine
            self._fingerprint = Fingerprint.current(path, engine.layout())
            self.tiers.attach(engine, self._fingerprint)
        return self._engine

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
        return self.plan.note if self.plan is not None else None

    @property
    def fingerprint(self) -> Fingerprint:
        self.load_engine()
        assert self._fingerprint is not None
        return self._fingerprint

    def close(self) -> None:
        """Save the hot session if it has unsaved KV, then release everything (an engine
        given to the constructor is left open for its owner)."""
        if self._engine is not None:
            self.tiers.detach()
            if self._engine is not self._given_engine:
                self._engine.close()
            self._engine = None
        self.store.close()

    # --- the KV cache ------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, Any]:
        """Both tiers and the persistent counters, for ``kvchat cache`` and the app."""
        return self.tiers.stats()

    def cache_gc(self) -> CacheGc:
        """Remove orphaned files and unused chunks, evict snapshots beyond the disk budget."""
        return self.tiers.gc()

    def cache_clear(self, session_id: str | None = None) -> int:
        """Delete the saved KV of one session, or of all; returns snapshots deleted. Text is kept."""
        return self.tiers.clear(session_id)

    def make_hot(
        self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it.

        Hot → RAM → disk (its own snapshot, or the longest prefix another session's
        snapshot shares with ``prompt``, by default its whole history) → none.
        """
        self.load_engine()
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
                    self._retitle(session_id, _title_from(text))
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
            raise KvchatError(_os_error(f"cannot lock session {session_id}", exc)) from None
        try:
            yield
        finally:
            held.__exit__(None, None, None)

    def regenerate(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Replace the last reply with a new one (the prompt is already in the context).

        The old reply is deleted only once the new one is stored.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        with self._turn_lock(session_id):
            history = self.store.messages(session_id)
            if not history:
                raise KvchatError("nothing to regenerate: the session has no messages")
            replaces = history[-1].id if history[-1].role == "assistant" else None
            return self._turn(session_id, params, on_token, cancel, no_restore, replaces)

    def continue_reply(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Go on with the last reply (one cut at the token limit): generate more after it and
        append that to the stored message.

        The prompt is the history with the reply left open; the context already holds it
        (hot, or restored), so only what differs is decoded before generating.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        with self._turn_lock(session_id):
            history = self.store.messages(session_id)
            if not history or history[-1].role != "assistant":
                raise KvchatError("nothing to continue: the session does not end with a reply")
            last = history[-1]
            engine = self.load_engine()
            self._remember(session_id)
            head = self._system_head(session)
            prompt = engine.chat_tokens(head + [m.as_chat() for m in history[:-1]])
            prompt += engine.tokenize(last.content)
            if len(prompt) + 1 >= engine.n_ctx:
                raise KvchatError(
                    f"the context is full ({len(prompt):,} of {engine.n_ctx:,} tokens): "
                    "no room to continue this reply"
                )
            stats = GenerationStats()
            restore = self.make_hot(session_id, no_restore=no_restore, prompt=prompt)
            self.tiers.mark_hot(session_id)
            prefill = engine.prefill(prompt, cancel)
            self.tiers.mark_dirty()
            pieces: list[str] = []
            _stream(
                engine,
                params,
                stats,
                cancel,
                on_token,
                pieces,
                complete_prompt=(prefill.reused + prefill.decoded >= len(prompt)),
            )
            more = "".join(pieces)
            report = TurnReport.of_run(session_id, more, restore, prefill, stats)
            if more:
                try:
                    message = self.store.update_message(
                        last.id,
                        last.content + more,
                        report.partial,
                        token_count=last.token_count + stats.generated,
                    )
                except KvchatError as exc:
                    report.reply_error = f"the continued reply could not be saved: {exc}"
                else:
                    report.message_id = message.id
            if report.message_id is not None and engine.n_tokens >= len(prompt):
                base = engine.chat_tokens(head + [m.as_chat() for m in history[:-1]])
                try:
                    self._settle(session, base)
                except KvchatError as exc:
                    report.window_note = f"the context was left as generated ({exc})"
            report.snapshot = self.tiers.save_hot()
            return report

    def probe_turn(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (for ``kvchat bench``).

        The session is made hot from scratch each time (the hot tier is skipped), and the
        context is left holding the probe, so the hot session is forgotten afterwards.
        """
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self.tiers.spill()
        restore = self.make_hot(session_id, no_restore=no_restore)
        chat = [m.as_chat() for m in self.store.messages(session_id)]
        prompt = engine.chat_tokens(
            self._system_head(session) + chat + [{"role": "user", "content": text}]
        )
        prefill = engine.prefill(prompt)
        params = GenerationParams(temperature=0.0, max_tokens=1)
        reply = "".join(engine.generate(params, stats))
        self.tiers.mark_hot(None)
        return TurnReport.of_run(session_id, reply, restore, prefill, stats)

    def _history_tokens(self, session_id: str) -> list[int] | None:
        """The session's whole history as prompt tokens (None when it has no messages)."""
        history = self.store.messages(session_id)
        if not history:
            return None
        session = self.store.get_session(session_id)
        chat = self._system_head(session) + [m.as_chat() for m in history]
        return self.engine.chat_tokens(chat)

    def _system_head(self, session: Session) -> list[dict[str, str]]:
        return system_head(session.system_prompt or self.settings.system_prompt)

    def _turn(
        self,
        session_id: str,
        params: GenerationParams,
        on_token: TokenCallback | None,
        cancel: CancelCheck | None,
        no_restore: bool,
        replaces: int | None = None,
    ) -> TurnReport:
        """Run the model on the session's history (without message ``replaces``) and store
        its reply (then delete ``replaces``). Called with the session's turn lock held."""
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self._remember(session_id)
        history = [m for m in self.store.messages(session_id) if m.id != replaces]
        chat = [m.as_chat() for m in history]
        reserve = min(params.max_tokens, engine.n_ctx // 4)
        head = self._system_head(session)
        prompt, dropped = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        restore = self.make_hot(session_id, no_restore=no_restore, prompt=prompt)
        self.tiers.mark_hot(session_id)
        shift = self._shift_window(head, chat, prompt, dropped)
        prefill = engine.prefill(prompt, cancel)
        self.tiers.mark_dirty()
        pieces: list[str] = []
        # A new reply is kept as it streams (a regenerated one is not: the old reply stays
        # until the new one is whole), so a killed process leaves the partial text.
        saver = (
            _StreamSaver(self.store, session_id, STREAM_SAVE_EVERY_S) if replaces is None else None
        )
        _stream(
            engine,
            params,
            stats,
            cancel,
            on_token,
            pieces,
            complete_prompt=prefill.reused + prefill.decoded >= len(prompt),
            saver=saver,
        )
        reply = "".join(pieces)
        streamed = saver.message_id if saver is not None else None
        report = TurnReport.of_run(
            session_id,
            reply,
            restore,
            prefill,
            stats,
            dropped_messages=dropped,
            shifted_tokens=shift.tokens,
            shifted_messages=shift.messages,
            window_note=shift.note,
        )
        # From here on the reply exists: whatever fails is reported, never raised.
        if reply.strip():
            try:
                if streamed is not None:  # the final commit replaces the streamed text
                    message = self.store.update_message(
                        streamed, reply, report.partial, token_count=stats.generated
                    )
                else:
                    message = self.store.add_message(
                        session_id,
                        "assistant",
                        reply,
                        token_count=stats.generated,
                        partial=report.partial,
                    )
            except KvchatError as exc:
                report.reply_error = f"the reply could not be saved: {exc}"
            else:
                report.message_id = message.id
        elif streamed is not None:
            try:
                self.store.delete_message(streamed)
            except KvchatError:
                pass
        if replaces is not None and report.message_id is not None:
            try:
                self.store.delete_message(replaces)
            except KvchatError as exc:
                report.reply_error = f"the old reply could not be removed: {exc}"
        if report.message_id is not None and engine.n_tokens >= len(prompt):
            try:
                self._settle(session, prompt, dropped)
            except KvchatError as exc:
                report.window_note = f"the context was left as generated ({exc})"
        report.snapshot = self.tiers.save_hot()
        return report

    def _shift_window(
        self,
        head: list[dict[str, str]],
        chat: list[dict[str, str]],
        prompt: list[int],
        dropped: int,
    ) -> WindowShift:
        """When old messages left the window: move them out of the KV instead of re-reading.

        :func:`kvchat.window.plan_shift` finds the block of held tokens those messages
        are; those positions are removed and the rest shifted down (a context shift), so
        the prefill reuses the shifted KV and decodes only the new turn. An engine whose
        cache cannot shift re-reads the kept window, and says so.
        """
        engine = self.engine
        plan = plan_shift(engine.chat_tokens, head, chat, engine.tokens, prompt, dropped)
        if plan is None:
            return WindowShift()
        kept = f"re-read the kept window ({len(prompt) - plan.start:,} tokens after the first {plan.start:,})"
        if not plan.found:
            return WindowShift(
                note=f"the context does not hold the messages that left the window: {kept}"
            )
        if not engine.capabilities.can_shift:
            return WindowShift(note=f"this model's KV cache cannot be shifted: {kept}")
        n_discard = engine.shift(plan.start, plan.end)
        if not n_discard:
            return WindowShift(
                note="llama.cpp did not take back the shifted KV: "
                f"re-read the kept window ({len(prompt):,} tokens)"
            )
        return WindowShift(tokens=n_discard, messages=plan.messages)

    def _settle(self, session: Session, prompt: list[int], dropped: int = 0) -> int:
        """Leave the context holding exactly the next turn's prompt up to the user's words.

        The reply is re-decoded in batches (see ``Engine.settle``), followed by what the
        template puts between the reply and the next user's words (see
        :func:`kvchat.window.settle_target`): known already, so decoding it now takes it
        off the next turn's time to first token. Returns the number of tokens decoded.
        """
        engine = self.engine
        messages = self.store.messages(session.id)[dropped:]  # the window's messages
        chat = self._system_head(session) + [m.as_chat() for m in messages]
        target = settle_target(engine.chat_tokens, chat, prompt, engine.tokens, engine.n_ctx)
        return engine.settle(len(prompt), target)


def _stream(
    engine: Engine,
    params: GenerationParams,
    stats: GenerationStats,
    cancel: CancelCheck | None,
    on_token: TokenCallback | None,
    pieces: list[str],
    *,
    complete_prompt: bool,
    saver: _StreamSaver | None = None,
) -> None:
    """Generate into ``pieces`` (and ``on_token``); a prefill cut short is a cancelled turn."""
    if not complete_prompt:
        stats.finish_reason = "cancelled"
        return
    for piece in engine.generate(params, stats, cancel):
        pieces.append(piece)
        if on_token is not None:
            on_token(piece)
        if saver is not None:
            saver.tick(pieces, stats.generated)


class _StreamSaver:
    """Stores a streaming reply as a partial message after its first second, then updates it
    every second (a convenience: a store that refuses is skipped, the final commit retries)."""

    def __init__(self, store: Store, session_id: str, every_s: float = STREAM_SAVE_EVERY_S):
        self.store = store
        self.session_id = session_id
        self.every_s = every_s
        self.message_id: int | None = None
        self._next = time.monotonic() + every_s

    def tick(self, pieces: list[str], generated: int) -> None:
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        text = "".join(pieces)
        if not text.strip():
            return
        try:
            if self.message_id is None:
                self.message_id = self.store.add_message(
                    self.session_id, "assistant", text, token_count=generated, partial=True
                ).id
            else:
                self.store.update_message(self.message_id, text, True, token_count=generated)
        except KvchatError:
            pass


def _check_config(engine: Engine, wanted: Any, explicit: set[str]) -> None:
    """An engine handed to the service must be on the same model file and have every
    context setting these settings set (flags, environment, config file, arguments).

    What the settings leave to the planner is the engine's: a plan made now could differ
    from the one the engine was opened with (on a GPU, the engine itself uses the memory
    the planner measures).
    """
    have = engine.config
    differ = [
        f"{f.name}={getattr(have, f.name)!r} (wanted {getattr(wanted, f.name)!r})"
        for f in fields(wanted)
        if (f.name == "model_path" or f.name in explicit)
        and getattr(have, f.name) != getattr(wanted, f.name)
    ]
    if differ:
        raise ValueError(f"the engine given to ChatService has other settings: {', '.join(differ)}")


def disk_full(directory: Path) -> bool:
    """Whether the filesystem holding ``directory`` (or its nearest parent) has no room."""
    for place in (directory, *directory.parents):
        try:
            stat = os.statvfs(place)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize < FULL_BELOW_BYTES
    return False


def _os_error(what: str, exc: OSError) -> str:
    """One line for an OSError, naming a full disk as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full: {what} ({exc.strerror})"
    return f"{what}: {exc.strerror or exc}"


@contextmanager
def open_service(settings: Settings, home: Path | None = None) -> Iterator[ChatService]:
    """A service that is closed (the hot session saved) however the block ends."""
    service = ChatService(settings, home=home)
    try:
        yield service
    finally:
        service.close()


def _title_from(text: str, limit: int = 48) -> str:
    line = one_line(text)
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
