"""Running the model for a turn: the new reply to the session's history, and the probe the
benchmark times (mixed into ChatService)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvchat.engine import CancelCheck, Engine, GenerationParams, GenerationStats, PrefillResult
from kvchat.errors import KvchatError
from kvchat.service.book import DEFAULT_TITLE
from kvchat.service.checks import os_error_line
from kvchat.service.context_window import fit_window
from kvchat.service.parts import ServiceParts
from kvchat.service.reports import (
    MessageRefused,
    TokenCallback,
    TurnReport,
    UnansweredMessage,
    generation_params,
)
from kvchat.service.streaming import StreamSaver, stream_reply
from kvchat.store import Message
from kvchat.store.locks import SessionBusy
from kvchat.store.store import StoreFull
from kvchat.text import check_text, short_title

# How long post() waits for the session's turn lock by default (as a turn does).
POST_WAIT_S = 3.0

# (tokens read so far, tokens to read, seconds since the prefill started)
PrefillProgress = Callable[[int, int, float], None]


class TurnRunner(ServiceParts):
    """A turn's model work: make the session hot, fit and shift the window, prefill, stream
    the reply (kept as it streams), store it, settle, save the snapshot."""

    # How often a streaming reply is stored (ChatService sets it from STREAM_SAVE_EVERY_S).
    stream_save_every_s: float
    # A caller's hook for the prompt read before a reply: called on the engine thread between
    # the prefill's batches (a long paste can take minutes; a UI shows how far it is).
    prefill_progress: PrefillProgress | None = None

    def _read_prompt(
        self, engine: Engine, prompt: list[int], cancel: CancelCheck | None
    ) -> PrefillResult:
        """``engine.prefill``, reporting its progress to :attr:`prefill_progress`."""
        hook = self.prefill_progress
        if hook is None:
            return engine.prefill(prompt, cancel)
        started = time.perf_counter()
        base: int | None = None

        def check() -> bool:  # asked before each batch: the context holds what was read
            nonlocal base
            held = engine.n_tokens
            base = held if base is None else base
            hook(held - base, len(prompt) - base, time.perf_counter() - started)
            return cancel is not None and cancel()

        return engine.prefill(prompt, check)

    def post(self, session_id: str, text: str, *, wait_s: float = POST_WAIT_S) -> Message:
        """Commit the user's message now, without the model: a UI calls it off its engine
        thread, so what was sent is stored the moment Enter is pressed even while the engine
        finishes other work; :meth:`answer` then runs the turn on it.

        Only text that is valid and not empty is stored; whether it fits the context is
        :meth:`answer`'s check (it needs the model). The session's turn lock is held while it
        is stored: while another process runs a turn on the session, it waits ``wait_s``
        seconds, then raises :class:`MessageRefused` (``busy``) and stores nothing.
        """
        text = check_text(text).strip()
        if not text:
            raise KvchatError("the message is empty")
        session = self.store.get_session(session_id)
        try:
            held = self.locks.hold(session_id, wait_s)
            held.__enter__()
        except SessionBusy as exc:
            raise MessageRefused(text, str(exc), busy=True) from None
        except OSError as exc:
            raise KvchatError(os_error_line(f"cannot lock session {session_id}", exc)) from None
        try:
            message = self.store.add_message(session_id, "user", text)
            if session.title == DEFAULT_TITLE:
                try:
                    self.store.update_session(session_id, title=short_title(text))
                except StoreFull:
                    pass  # a title is a convenience: the message is stored
        finally:
            held.__exit__(None, None, None)
        return message

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
        """Run the turn on the user's message ``message_id`` that :meth:`post` stored (it must
        still be the session's last message) and commit the reply, as :meth:`send` does.

        A message too long to fit the context is deleted again (it was never answered) and
        :class:`MessageRefused` carries its text back; any later failure leaves it stored,
        unanswered (:class:`UnansweredMessage`).
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        with self._turn_lock(session_id):
            history = self.store.messages(session_id)
            last = history[-1] if history else None
            if last is None or last.id != message_id or last.role != "user":
                raise KvchatError("the message to answer is no longer the session's last one")
            engine = self.load_engine()
            try:
                self._checked_message(last.content, session.system_prompt, params.max_tokens)
            except KvchatError as exc:
                self.store.delete_message(message_id)
                raise MessageRefused(last.content, str(exc)) from exc
            try:
                count = engine.count_tokens(last.content)
                self.store.update_message(message_id, last.content, False, token_count=count)
                return self._turn(session_id, params, on_token, cancel, no_restore)
            except KvchatError as exc:
                raise UnansweredMessage(session_id, str(exc)) from exc

    def probe_turn(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (for ``kvchat bench``).

        The session is made hot from scratch each time (the hot tier is skipped), and the
        context is left holding the probe, so the hot session is forgotten afterwards.
        """
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self._abandon_upkeep()
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
        its reply (as a new version of ``replaces``: the earlier ones are kept). Called with
        the session's turn lock held."""
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
        prefill = self._read_prompt(engine, prompt, cancel)
        self.tiers.mark_dirty()
        # A new reply is kept as it streams (a regenerated one is not: the old reply stays
        # until the new one is whole), so a killed process leaves the partial text.
        saver = (
            StreamSaver(self.store, session_id, self.stream_save_every_s)
            if replaces is None
            else None
        )
        reply = stream_reply(engine, prefill, params, stats, cancel, on_token, saver)
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
                ended = report.finish_reason  # stored with it: "length" shows as cut
                if replaces is not None:  # a new version; the earlier ones are kept
                    message = self.store.add_version(
                        replaces,
                        reply,
                        token_count=stats.generated,
                        partial=report.partial,
                        finish_reason=ended,
                    )
                elif streamed is not None:  # the final commit replaces the streamed text
                    message = self.store.update_message(
                        streamed,
                        reply,
                        report.partial,
                        token_count=stats.generated,
                        finish_reason=ended,
                    )
                else:
                    message = self.store.add_message(
                        session_id,
                        "assistant",
                        reply,
                        token_count=stats.generated,
                        partial=report.partial,
                        finish_reason=ended,
                    )
            except KvchatError as exc:
                report.reply_error = f"the reply could not be saved: {exc}"
                if streamed is not None and saver is not None:  # what the database holds
                    report.stored_part = saver.stored_chars
                    report.reply_error = (
                        f"the reply could not be saved whole: {exc}; the database keeps its "
                        f"first {saver.stored_chars:,} of {len(reply):,} characters, marked "
                        "partial"
                    )
            else:
                report.message_id = message.id
        elif streamed is not None:
            try:
                self.store.delete_message(streamed)
            except KvchatError:
                pass
        self._after_reply(report, session, prompt, dropped)
        return report
