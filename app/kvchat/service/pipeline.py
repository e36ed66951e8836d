"""One turn's model work, for every kind of turn: send, answer a posted message, regenerate,
continue a reply, and the benchmark's probe.

Each turn goes the same way: make the session hot, fit (and shift) the window, read the
prompt, stream the reply (kept as it streams), store it, then hand the settle and the
snapshot write to :class:`~kvchat.service.upkeep.Upkeep`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvchat.documents import render_block
from kvchat.engine import (
    CancelCheck,
    GenerationParams,
    GenerationStats,
    PrefillResult,
    TokenEngine,
    common_prefix,
)
from kvchat.errors import KvchatError
from kvchat.kvcache import RestoreResult
from kvchat.service.book import DEFAULT_TITLE, SessionBook
from kvchat.service.checks import os_error_line
from kvchat.service.context_window import (
    ChatMessage,
    after_summary,
    fit_window,
    plan_shift,
    reply_reserve,
    system_head,
    with_summary,
)
from kvchat.service.documents import (
    DocumentFit,
    DocumentShelf,
    ReadDocuments,
    as_document,
    reading_id,
    system_message,
)
from kvchat.service.engine_host import EngineHost
from kvchat.service.model_choices import ModelChoices
from kvchat.service.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningStyle,
    as_written,
    split_reasoning,
)
from kvchat.service.reports import (
    NEXT_MESSAGE_ALLOWANCE,
    MessageRefused,
    TokenCallback,
    TokenCounts,
    TurnReport,
    UnansweredMessage,
    WindowShift,
    WindowView,
    figures_of,
    generation_params,
    session_think,
)
from kvchat.service.streaming import (
    SAVE_TROUBLE_AFTER_S,
    STREAM_SAVE_EVERY_S,
    SaveTrouble,
    StreamSaver,
    stream_reply,
)
from kvchat.service.turn_lock import turn_lock
from kvchat.service.upkeep import Upkeep
from kvchat.store import Message, Session, Store
from kvchat.store.locks import SessionBusy, SessionLocks
from kvchat.store.store import StoreFull
from kvchat.store.tools_sql import ToolRecord
from kvchat.text import check_text, one_line, short_title

# How long post() waits for the session's turn lock by default (as a turn does).
POST_WAIT_S = 3.0

# (tokens read so far, tokens to read, seconds since the prefill started)
PrefillProgress = Callable[[int, int, float], None]


@dataclass
class TurnOptions:
    """How the caller runs a turn: streaming, stopping, and whether to restore."""

    on_token: TokenCallback | None = None
    cancel: CancelCheck | None = None
    no_restore: bool = False


@dataclass
class PromptRead:
    """How a turn's prompt came into the context."""

    restore: RestoreResult
    prefill: PrefillResult
    shift: WindowShift


class TurnPipeline:
    """The turns of the conversation service (see the module docstring)."""

    def __init__(
        self,
        host: EngineHost,
        store: Store,
        locks: SessionLocks,
        book: SessionBook,
        upkeep: Upkeep,
        models: ModelChoices,
        documents: DocumentShelf,
    ) -> None:
        self.host = host
        self.documents = documents
        self.store = store
        self.locks = locks
        self.book = book
        self.upkeep = upkeep
        self.models = models
        # How often a streaming reply is stored.
        self.stream_save_every_s = STREAM_SAVE_EVERY_S
        # A caller's hook for the prompt read before a reply: called on the engine thread
        # between the prefill's batches (a long paste can take minutes; a UI shows how far
        # it is).
        self.prefill_progress: PrefillProgress | None = None
        # A caller's hook told, on the engine thread, that a streaming reply is not being
        # saved (one line, after save_trouble_after_s of failed saves), or is again (None).
        self.save_trouble: SaveTrouble | None = None
        self.save_trouble_after_s = SAVE_TROUBLE_AFTER_S
        # The tools a session's prompts offer the model, as its chat template takes them
        # (kvchat.service.tools.ToolTurns.offered; None: no tools).
        self.offer_tools: Callable[[str], list[dict[str, Any]] | None] | None = None

    # --- what a turn starts from ----------------------------------------------------------

    def head(self, session: Session) -> list[dict[str, str]]:
        """The system message the session's prompts start with: its system prompt and the
        documents it started with (none when it has neither)."""
        return self.documents.head(
            session, session.system_prompt or self.host.settings.system_prompt
        )

    def window(
        self, session: Session, history: list[Message], thinks: bool = False
    ) -> tuple[list[ChatMessage], list[ChatMessage], list[Message], int]:
        """What the session's prompts render: the head (with the compaction summary, when
        there is one), the messages after the summary for a template and as stored, and
        how many messages the summary stands for."""
        summary = self.store.current_summary(session.id)
        kept, summarized = after_summary(history, summary)
        head = self.head(session)
        if summary is not None and summarized:
            head = with_summary(head, summary.text)
        return head, self.documents.chat(session.id, kept, thinks), kept, summarized

    def _summary_text(self, session_id: str) -> str | None:
        summary = self.store.current_summary(session_id)
        return summary.text if summary is not None else None

    def check_documents(
        self, read: ReadDocuments, system_prompt: str | None, max_tokens: int
    ) -> DocumentFit | None:
        """Whether documents a new conversation starts with leave room for it (one line when
        they do not); the figures say how much they take and how long they take to read
        here. None where the engine takes whole messages (a server fits its own context)."""
        engine = self.host.load().token_level()
        if engine is None:
            return None
        block = render_block(as_document(row) for row in read.rows)
        head = system_message(system_prompt or self.host.settings.system_prompt, block)
        probe = self.host.probe
        threads = probe.best_threads("prefill") if probe is not None else None
        speed = probe.speed(threads, "prefill") if probe is not None and threads else None
        reserve = reply_reserve(max_tokens, engine.n_ctx)
        return self.documents.fit(engine, head, reserve, speed)

    def check_later_documents(
        self, session_id: str, read: ReadDocuments, max_tokens: int
    ) -> DocumentFit | None:
        """Whether documents sent with the session's next message leave room for it and a
        reply after its history (one line when they do not), with the same figures as
        :meth:`check_documents`. None where the engine takes whole messages."""
        engine = self.host.load().token_level()
        if engine is None:
            return None
        tokens = engine.count_tokens(render_block(as_document(row) for row in read.rows))
        held = len(self.history_tokens(session_id) or [])
        reserve = reply_reserve(max_tokens, engine.n_ctx)
        room = engine.n_ctx - held - tokens - reserve
        probe = self.host.probe
        threads = probe.best_threads("prefill") if probe is not None else None
        speed = probe.speed(threads, "prefill") if probe is not None and threads else None
        if room < 64:
            raise KvchatError(
                f"the documents take {tokens:,} tokens and the conversation {held:,} of a "
                f"{engine.n_ctx:,}-token context, leaving no room for a reply "
                f"({reserve:,} kept for it): attach fewer, or start a new conversation"
            )
        return DocumentFit(tokens, engine.n_ctx, room, tokens / speed if speed else None)

    def checked_message(self, text: str, system_prompt: str | None, max_tokens: int) -> str:
        """The message stripped, if it is text, not empty, and fits the context alone."""
        text = check_text(text).strip()
        if not text:
            raise KvchatError("the message is empty")
        if self.host.takes_messages:
            return text  # the server fits its own context (a refusal keeps the message)
        engine = self.host.token_engine()
        head = system_head(system_prompt or self.host.settings.system_prompt)
        reserve = reply_reserve(max_tokens, engine.n_ctx)
        fit_window(
            engine.chat_tokens, head, [{"role": "user", "content": text}], engine.n_ctx, reserve
        )
        return text

    def history_tokens(self, session_id: str) -> list[int] | None:
        """The session's history as its next turn's prompt starts: the newest messages that
        fit the context (all of them, mostly; rendering all of a 5,000-message import to
        look for a shared prefix took ~8 s). None when it has no messages, or when not even
        its last one fits."""
        history = self.store.messages(session_id)
        if not history:
            return None
        session = self.store.get_session(session_id)
        thinks = self.host.reasoning_style.thinks
        head, chat, _, _ = self.window(session, history, thinks)
        engine = self.host.token_engine()
        reserve = reply_reserve(
            generation_params(self.host.settings, session.settings, {}).max_tokens, engine.n_ctx
        )
        try:
            tokens, _ = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        except KvchatError:
            return None
        return tokens

    def make_hot(
        self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it.

        Hot → RAM → disk (its own snapshot, or the longest prefix another session's
        snapshot shares with ``prompt``, by default its whole history) → none.
        """
        engine = self.host.load()
        self.upkeep.abandon()  # the last turn's housekeeping yields to this
        tiers = self.host.tiers
        level = engine.token_level()
        if prompt is not None and tiers.hot_session_id == session_id and level is not None:
            if not level.n_tokens:
                # A session made hot while it had no message (the app opens a new one at
                # once) holds nothing: its first prompt may still borrow another session's
                # prefix (documents read once, the same system prompt).
                tiers.mark_hot(None)
        return tiers.make_hot(
            session_id,
            no_restore=no_restore,
            prompt=prompt,
            history=lambda: self.history_tokens(session_id),
        )

    # --- the user's message ---------------------------------------------------------------

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
                self._retitle(session_id, short_title(text))
        finally:
            held.__exit__(None, None, None)
        return message

    def post_with_documents(
        self, session_id: str, text: str, documents: ReadDocuments, *, wait_s: float = POST_WAIT_S
    ) -> tuple[Message, bool]:
        """:meth:`post` with documents: at the session's start when it has no message yet
        (read once for every conversation started with them), else with this message (read
        once for this conversation). When the documents cannot be stored the message is
        deleted again and the error raised: nothing of either is kept. Returns the message
        and whether the documents went at the start."""
        at_start = not self.store.messages_page(session_id, 1)
        message = self.post(session_id, text, wait_s=wait_s)
        try:
            self.documents.give(session_id, documents, None if at_start else message.id)
        except BaseException:
            self.store.delete_message(message.id)
            raise
        return message, at_start

    def send(
        self,
        session_id: str,
        text: str,
        options: TurnOptions,
        overrides: dict[str, Any],
        documents: ReadDocuments | None = None,
    ) -> TurnReport:
        """Commit the user's message, then run the model and commit its reply (see
        ``ChatService.send``)."""
        session = self.store.get_session(session_id)
        params = generation_params(self.host.settings, session.settings, overrides)
        text = self.checked_message(text, session.system_prompt, params.max_tokens)
        with turn_lock(self.locks, session_id):
            if self.host.takes_messages:  # opened in the turn: a refusal keeps the message
                message = self.store.add_message(session_id, "user", text)
            else:
                engine = self.host.load()
                count = engine.count_tokens(text)
                message = self.store.add_message(session_id, "user", text, token_count=count)
            if documents is not None:
                self.documents.give(session_id, documents, message.id)
            try:
                if session.title == DEFAULT_TITLE:
                    self._retitle(session_id, short_title(text))
                return self.run(session_id, params, options)
            except KvchatError as exc:
                raise UnansweredMessage(session_id, str(exc)) from exc

    def answer(
        self, session_id: str, message_id: int, options: TurnOptions, overrides: dict[str, Any]
    ) -> TurnReport:
        """Run the turn on the user's message ``message_id`` that :meth:`post` stored (it must
        still be the session's last message) and commit the reply, as :meth:`send` does.

        A message too long to fit the context is deleted again (it was never answered) and
        :class:`MessageRefused` carries its text back; any later failure leaves it stored,
        unanswered (:class:`UnansweredMessage`).
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.host.settings, session.settings, overrides)
        with turn_lock(self.locks, session_id):
            history = self.store.messages(session_id)
            last = history[-1] if history else None
            if last is None or last.id != message_id or last.role != "user":
                raise KvchatError("the message to answer is no longer the session's last one")
            engine = self.host.load()
            try:
                self.checked_message(last.content, session.system_prompt, params.max_tokens)
            except KvchatError as exc:
                self.store.delete_message(message_id)
                raise MessageRefused(last.content, str(exc)) from exc
            try:
                if not engine.capabilities.remote_chat:  # the server counts its own tokens
                    count = engine.count_tokens(last.content)
                    self.store.update_message(message_id, last.content, False, token_count=count)
                return self.run(session_id, params, options)
            except KvchatError as exc:
                raise UnansweredMessage(session_id, str(exc)) from exc

    def _retitle(self, session_id: str, title: str) -> None:
        try:
            self.store.update_session(session_id, title=title)
        except StoreFull:
            pass  # a title is a convenience: the turn goes on

    # --- turns on the last reply ------------------------------------------------------------

    def regenerate(
        self, session_id: str, options: TurnOptions, overrides: dict[str, Any]
    ) -> TurnReport:
        """A new version of the last reply (the prompt is already in the context).

        The earlier versions are kept (see ``SessionBook.switch_version``); the new one
        becomes current once it is stored, in one transaction with the version list.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.host.settings, session.settings, overrides)
        with turn_lock(self.locks, session_id):
            history = self.store.messages(session_id)
            if not history:
                raise KvchatError("nothing to regenerate: the session has no messages")
            replaces = history[-1].id if history[-1].role == "assistant" else None
            return self.run(session_id, params, options, replaces)

    def continue_reply(
        self, session_id: str, options: TurnOptions, overrides: dict[str, Any]
    ) -> TurnReport:
        """Go on with the last reply (one cut at the token limit): generate more after it and
        append that to the stored message.

        The prompt is the history with the reply left open; the context already holds it
        (hot, or restored), so only what differs is decoded before generating.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.host.settings, session.settings, overrides)
        with turn_lock(self.locks, session_id):
            history = self.store.messages(session_id)
            if not history or history[-1].role != "assistant":
                raise KvchatError("nothing to continue: the session does not end with a reply")
            last = history[-1]
            if self.host.load().capabilities.remote_chat:
                raise KvchatError(
                    "an OpenAI-compatible server cannot go on inside a reply: regenerate it "
                    "with a larger --max-tokens instead"
                )
            engine = self.host.token_engine()
            self._template_options(session)
            style = self.host.reasoning_style
            self.book.remember(session_id)
            head, earlier, _, _ = self.window(session, history[:-1], style.thinks)
            base = engine.chat_tokens(head + earlier)
            written = as_written(last.reasoning, last.content, style)
            prompt = base + engine.tokenize(written)
            if len(prompt) + 1 >= engine.n_ctx:
                raise KvchatError(
                    f"the context is full ({len(prompt):,} of {engine.n_ctx:,} tokens): "
                    "no room to continue this reply"
                )
            stats = GenerationStats()
            read = self._hot_prompt(session_id, prompt, options)
            more = stream_reply(
                engine, read.prefill, params, stats, options.cancel, options.on_token
            )
            reasoning, answer = split_reasoning(written + more, style)
            report = TurnReport.of_run(session_id, more, read.restore, read.prefill, stats)
            if more:
                try:
                    message = self.store.update_message(
                        last.id,
                        answer,
                        report.partial,
                        token_count=last.token_count + stats.generated,
                        finish_reason=report.finish_reason,
                        reasoning=reasoning,
                    )
                except KvchatError as exc:
                    report.reply_error = f"the continued reply could not be saved: {exc}"
                else:
                    report.message_id = message.id
            if engine.n_tokens < len(prompt):
                base = prompt  # cut short: nothing to settle (see Upkeep.after_reply)
            self._finish(report, session, base)
            return report

    # --- the benchmark's probe ------------------------------------------------------------

    def probe(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (for ``kvchat bench``).

        The session is made hot from scratch each time (the hot tier is skipped), and the
        context is left holding the probe, so the hot session is forgotten afterwards.
        """
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        if self.host.load().capabilities.remote_chat:
            raise KvchatError("the benchmark times kvchat's own engines, not a remote server")
        engine = self.host.token_engine()
        self.upkeep.abandon()
        self._template_options(session)
        tiers = self.host.tiers
        tiers.spill()
        restore = self.make_hot(session_id, no_restore=no_restore)
        thinks = self.host.reasoning_style.thinks
        chat = self.documents.chat(session_id, self.store.messages(session_id), thinks)
        prompt = engine.chat_tokens(self.head(session) + chat + [{"role": "user", "content": text}])
        prefill = engine.prefill(prompt)
        params = GenerationParams(temperature=0.0, max_tokens=1)
        reply = "".join(engine.generate(params, stats))
        tiers.mark_hot(None)
        return TurnReport.of_run(session_id, reply, restore, prefill, stats)

    # --- the turn itself ----------------------------------------------------------------------

    def run(
        self,
        session_id: str,
        params: GenerationParams,
        options: TurnOptions,
        replaces: int | None = None,
    ) -> TurnReport:
        """Run the model on the session's history (without message ``replaces``) and store
        its reply (as a new version of ``replaces``: the earlier ones are kept). Called with
        the session's turn lock held."""
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        if self.host.load().capabilities.remote_chat:
            return self.run_remote(session_id, params, options, replaces)
        engine = self.host.token_engine()
        self._template_options(session)
        style = self.host.reasoning_style
        self.book.remember(session_id)
        history = [m for m in self.store.messages(session_id) if m.id != replaces]
        head, chat, kept, summarized = self.window(session, history, style.thinks)
        reserve = reply_reserve(params.max_tokens, engine.n_ctx)
        prompt, dropped = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        shared = 0
        if head and not dropped and not summarized and self.documents.start_block(session_id):
            shared = self.documents.shared_end(engine, head)
        read = self._hot_prompt(
            session_id,
            prompt,
            options,
            lambda: self._shift_window(head, chat, prompt, dropped),
            shared=shared,
        )
        # A new reply is kept as it streams (a regenerated one is not: the old reply stays
        # until the new one is whole), so a killed process leaves the partial text.
        saver = self._saver(session_id, style) if replaces is None else None
        written = stream_reply(
            engine, read.prefill, params, stats, options.cancel, options.on_token, saver
        )
        reasoning, reply = split_reasoning(written, style)
        report = TurnReport.of_run(
            session_id,
            reply,
            read.restore,
            read.prefill,
            stats,
            dropped_messages=dropped,
            shifted_tokens=read.shift.tokens,
            shifted_messages=read.shift.messages,
            window_note=read.shift.note,
            reasoning=reasoning,
        )
        report.written = written
        report.documents = self.documents.attached(session_id, engine.count_tokens)
        report.view = WindowView(
            n_ctx=engine.n_ctx,
            used=len(prompt) + stats.generated,
            reserve=reserve,
            first_message_id=kept[dropped].id if dropped or summarized else None,
            left_out=summarized + dropped,
            summarized=summarized,
            next_drops=len(prompt) + stats.generated + NEXT_MESSAGE_ALLOWANCE + reserve
            > engine.n_ctx,
            overflow=self.host.settings.overflow,
            summary=self._summary_text(session_id) if summarized else None,
        )
        # From here on the reply exists: whatever fails is reported, never raised.
        self._store_reply(report, session_id, stats, replaces, saver)
        self._finish(report, session, prompt, dropped)
        return report

    def run_remote(
        self,
        session_id: str,
        params: GenerationParams,
        options: TurnOptions,
        replaces: int | None = None,
    ) -> TurnReport:
        """:meth:`run` on an engine that takes whole messages (``capabilities.remote_chat``):
        the history goes as messages (role and content, in order: the server's cache can
        reuse the last request's prefix), the counts are the server's own figures (or "not
        reported"), and there is no settle or snapshot: the KV is the server's.

        The caller's stream (``on_token``, the stream saver) gets the server's
        ``reasoning_content`` inside think tags before the answer; the stored reasoning and
        answer are the server's two fields as sent."""
        remote = self.host.remote
        assert remote is not None
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        self.book.remember(session_id)
        history = [m for m in self.store.messages(session_id) if m.id != replaces]
        said = self.documents.chat(session_id, history)
        records = self.store.tool_records([m.id for m in history if m.role == "tool"])
        said = [
            remote_tool_result(entry, records.get(m.id)) if m.role == "tool" else entry
            for entry, m in zip(said, history, strict=True)
        ]
        chat = self.head(session) + said
        restore = self.host.tiers.make_hot(session_id)
        saver = self._saver(session_id, self.host.reasoning_style) if replaces is None else None
        reasoning: list[str] = []
        answer: list[str] = []
        pieces: list[str] = []  # as the caller's stream sees them
        think = session_think(session.settings)
        broke_off: str | None = None
        try:
            for kind, text in remote.chat(chat, params, stats, session_id, think, options.cancel):
                if kind == "reasoning":
                    piece = text if reasoning else f"{THINK_OPEN}\n{text}"
                    reasoning.append(text)
                else:
                    piece = f"\n{THINK_CLOSE}\n\n{text}" if reasoning and not answer else text
                    answer.append(text)
                pieces.append(piece)
                if options.on_token is not None:
                    options.on_token(piece)
                if saver is not None:
                    saver.tick(pieces, stats.generated)
        except KvchatError as exc:
            if not pieces:
                raise  # nothing was shown: the message stays, unanswered
            # What was shown is the reply: it is stored, marked partial, and the line says why.
            broke_off = f"{one_line(str(exc))}; the reply shown is saved, marked partial"
            stats.finish_reason = "cancelled"
        figures = remote.figures
        unreported = tuple(
            name
            for name in ("prompt", "reused", "decoded", "generated")
            if getattr(figures, name) is None
        )
        tokens = TokenCounts(
            figures.prompt or 0,
            figures.reused or 0,
            figures.decoded or 0,
            figures.generated or 0,
            unreported=unreported,
        )
        report = TurnReport(
            session_id=session_id,
            reply="".join(answer),
            tokens=tokens,
            restore=restore,
            ttft_ms=stats.ttft_ms,
            tokens_per_s=stats.tokens_per_s,
            finish_reason=stats.finish_reason,
            reasoning="".join(reasoning).strip(),
            remote=remote.url,
            remote_figures=figures.source,
            remote_note=remote_note(broke_off, figures.doubts),
        )
        self._store_reply(report, session_id, stats, replaces, saver)
        self.models.record(session_id)
        return report

    def _hot_prompt(
        self,
        session_id: str,
        prompt: list[int],
        options: TurnOptions,
        shift: Callable[[], WindowShift] = WindowShift,
        shared: int = 0,
    ) -> PromptRead:
        """Make the session hot for ``prompt``, move what left the window out (``shift``),
        and read the prompt. ``shared``: the prompt's first tokens every conversation about
        the same documents starts with; read here for the first time, they are saved as a
        reading of their own on the way (see :mod:`kvchat.service.documents`)."""
        restore = self.make_hot(session_id, no_restore=options.no_restore, prompt=prompt)
        tiers = self.host.tiers
        tiers.mark_hot(session_id)
        shifted = shift()
        engine = self.host.token_engine()
        reading = self._unread(engine, prompt[:shared]) if shared < len(prompt) else None
        if reading is not None:
            first = self._read_prompt(engine, prompt[:shared], options.cancel)
            if engine.n_tokens == shared:
                self._save_reading(session_id, reading)
            rest = self._read_prompt(engine, prompt, options.cancel)
            prefill = PrefillResult(len(prompt), first.reused, first.decoded + rest.decoded)
        else:
            prefill = self._read_prompt(engine, prompt, options.cancel)
        tiers.mark_dirty()
        return PromptRead(restore, prefill, shifted)

    def _unread(self, engine: TokenEngine, shared: list[int]) -> str | None:
        """The reading id of ``shared`` when the context does not hold it yet and nothing
        saved it before, else None."""
        if not shared or common_prefix(engine.tokens, shared) >= len(shared):
            return None
        config = engine.config
        reading = reading_id(shared, f"{config.model_path}|{config.type_k}|{config.type_v}")
        return None if self.host.tiers.snapshot(reading) is not None else reading

    def _save_reading(self, session_id: str, reading: str) -> None:
        """Save what the context holds (the documents' shared prefix) as ``reading``, then
        go on as ``session_id``; a failed write only means the next conversation reads the
        documents again."""
        names = ", ".join(u.document.name for u in self.documents.of_session(session_id))
        try:
            self.store.ensure_reading(reading, f"Reading of {names}")
        except KvchatError:
            return
        tiers = self.host.tiers
        tiers.mark_hot(reading)
        tiers.mark_dirty()
        tiers.save_hot()
        tiers.mark_hot(session_id)

    def _template_options(self, session: Session) -> None:
        """Render the session's prompts with its thinking choice and the tools it offers."""
        self.host.use_template_options(session_think(session.settings))
        tools = self.offer_tools(session.id) if self.offer_tools is not None else None
        if tools:
            engine = self.host.token_engine()
            engine.template_options = {**engine.template_options, "tools": tools}

    def _saver(self, session_id: str, style: ReasoningStyle) -> StreamSaver:
        """What keeps a new reply stored as it streams (see StreamSaver)."""
        return StreamSaver(
            self.store,
            session_id,
            self.stream_save_every_s,
            style,
            on_trouble=self.save_trouble,
            trouble_after_s=self.save_trouble_after_s,
        )

    def _store_reply(
        self,
        report: TurnReport,
        session_id: str,
        stats: GenerationStats,
        replaces: int | None,
        saver: StreamSaver | None,
    ) -> None:
        """Commit the reply (its answer, and its reasoning apart): a new version of
        ``replaces``, the final text of the streamed message, or a new message; a failure
        is written into ``report``."""
        reply, reasoning = report.reply, report.reasoning
        streamed = saver.message_id if saver is not None else None
        if not reply.strip() and not reasoning:
            if streamed is not None:
                try:
                    self.store.delete_message(streamed)
                except KvchatError:
                    pass
            return
        ended = report.finish_reason  # stored with it: "length" shows as cut
        try:
            if replaces is not None:  # a new version; the earlier ones are kept
                message = self.store.add_version(
                    replaces,
                    reply,
                    token_count=stats.generated,
                    partial=report.partial,
                    finish_reason=ended,
                    reasoning=reasoning,
                )
            elif streamed is not None:  # the final commit replaces the streamed text
                message = self.store.update_message(
                    streamed,
                    reply,
                    report.partial,
                    token_count=stats.generated,
                    finish_reason=ended,
                    reasoning=reasoning,
                )
            else:
                message = self.store.add_message(
                    session_id,
                    "assistant",
                    reply,
                    token_count=stats.generated,
                    partial=report.partial,
                    finish_reason=ended,
                    reasoning=reasoning,
                )
        except KvchatError as exc:
            report.reply_error = f"the reply could not be saved: {exc}"
            if streamed is not None and saver is not None:  # what the database holds
                report.stored_part = saver.stored_chars
                report.reply_error = (
                    f"the reply could not be saved whole: {exc}; the database keeps its "
                    f"first {saver.stored_chars:,} of {len(reply):,} characters, marked partial"
                )
        else:
            report.message_id = message.id
            if saver is not None and saver.trouble is not None:
                saver.trouble = None  # the reply is stored whole: nothing is missing now
                saver.tell(None)

    def _finish(
        self, report: TurnReport, session: Session, prompt: list[int], dropped: int = 0
    ) -> None:
        """After any turn: the session remembers its model and the reply its figures, then
        the settle and snapshot."""
        self.models.record(session.id)
        self._keep_figures(report)
        self.upkeep.after_reply(report, session, prompt, dropped)

    def _keep_figures(self, report: TurnReport) -> None:
        """Store the reply's figures with it (a convenience: a failure loses only them)."""
        if report.message_id is None:
            return
        model = report.remote or self.models.loaded_name
        try:
            self.store.record_figures(report.message_id, figures_of(report, model))
        except KvchatError:
            pass

    def _read_prompt(
        self, engine: TokenEngine, prompt: list[int], cancel: CancelCheck | None
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

    def _shift_window(
        self,
        head: list[dict[str, str]],
        chat: list[dict[str, str]],
        prompt: list[int],
        dropped: int,
    ) -> WindowShift:
        """When old messages left the window: move them out of the KV instead of re-reading.

        :func:`kvchat.service.context_window.plan_shift` finds the block of held tokens
        those messages are; those positions are removed and the rest shifted down (a
        context shift), so the prefill reuses the shifted KV and decodes only the new turn.
        An engine whose cache cannot shift re-reads the kept window, and says so.
        """
        engine = self.host.token_engine()
        state = engine.seq_state()
        plan = plan_shift(engine.chat_tokens, head, chat, engine.tokens, prompt, dropped)
        if plan is None:
            return WindowShift()
        kept = f"re-read the kept window ({len(prompt) - plan.start:,} tokens after the first {plan.start:,})"
        if not plan.found:
            return WindowShift(
                note=f"the context does not hold the messages that left the window: {kept}"
            )
        if state is None or not engine.capabilities.can_shift:
            return WindowShift(note=f"this model's KV cache cannot be shifted: {kept}")
        n_discard = state.shift(plan.start, plan.end)
        if not n_discard:
            return WindowShift(
                note="llama.cpp did not take back the shifted KV: "
                f"re-read the kept window ({len(prompt):,} tokens)"
            )
        return WindowShift(tokens=n_discard, messages=plan.messages)


def remote_tool_result(entry: dict[str, str], record: ToolRecord | None) -> dict[str, str]:
    """A tool message as an OpenAI-compatible server is sent it: only roles and contents
    go, and a ``tool`` role needs its call's id and the reply's ``tool_calls``, so it goes
    as the user's turn, labelled with the tool."""
    name = record.name if record is not None else "a tool"
    return {"role": "user", "content": f"Tool result ({name}):\n{entry['content']}"}


def remote_note(broke_off: str | None, doubts: list[str]) -> str | None:
    """What the status line adds for a server's turn: why its reply was cut off, and the
    figures it sent that are not shown (not counts, or contradicting each other)."""
    notes = [broke_off] if broke_off else []
    if doubts:
        notes.append("not shown: " + "; ".join(doubts))
    return " · ".join(notes) or None
