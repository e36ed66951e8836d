"""Compaction: a summary the model writes of the messages leaving the window, read instead
of them from then on (issue 42).

The conversation goes on from [system prompt, documents, summary, the newest messages]:
the summary is appended to the session's system message, so a template with no system
role (Gemma folds it into the first user turn) still places it before the kept messages.
The summary is stored as what it is (the ``summaries`` table, covering the messages up to
one id); the messages stay in SQLite, searchable and exported.

One compaction, in three steps a UI shows one at a time:

1. :meth:`Compactor.plan`: which messages the summary stands for, how many tokens it
   replaces, how long re-reading the kept ones takes at this machine's measured speed;
2. :meth:`Compactor.draft`: the model writes the summary. The session's KV is saved first
   (disk and RAM) and left as it is: the summary is decoded in the context beside it, not
   in it (the titles' scratch sequence has no room when the context is full, which is
   when compaction is due). Cancelable; nothing is stored;
3. :meth:`Compactor.accept`: the (edited) summary is checked, the compacted prompt read
   once, then the conversation before it kept as a branch (a fork, sharing its KV), the
   summary stored and the KV saved. Until the summary row is committed the session is as
   it was, and a kill during the read leaves no branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvchat.engine import CancelCheck, GenerationParams, GenerationStats, TokenEngine
from kvchat.errors import KvchatError
from kvchat.kvcache.tiers import SnapshotWrite
from kvchat.service.book import SessionBook
from kvchat.service.context_window import (
    ChatMessage,
    after_summary,
    fit_window,
    reply_reserve,
    settle_target,
    with_summary,
)
from kvchat.service.pipeline import TurnPipeline
from kvchat.service.reports import (
    NEXT_MESSAGE_ALLOWANCE,
    TokenCallback,
    WindowView,
    generation_params,
)
from kvchat.service.turn_lock import turn_lock
from kvchat.store import Message, Session
from kvchat.store.summaries_sql import Summary
from kvchat.text import check_text

# How the model is asked for a summary.
SUMMARY_SYSTEM = (
    "You summarize conversations so that they can go on without them. Write a short summary "
    "of the conversation below: the facts, names, numbers, decisions and open questions. "
    "Plain sentences only."
)
# The most tokens the model writes for a summary.
SUMMARY_TOKENS = 200
# What a compaction keeps: the newest messages that fit this share of the context left
# after the reply reserve, so many turns follow before the next one is due.
KEEP_SHARE = 0.5
# More characters than any token of a model's vocabulary takes, as a bound before counting.
CHARS_PER_TOKEN = 16
# The label of the branch that keeps the conversation as it was before a compaction.
BEFORE_LABEL = "Before compaction"


def transcript(messages: Sequence[Message], earlier: str | None) -> str:
    """The messages as the summary's source text (the earlier summary first)."""
    parts = [f"(Summary so far) {earlier}"] if earlier else []
    parts += [f"{m.role.capitalize()}: {m.content}" for m in messages]
    return "\n\n".join(parts)


@dataclass(frozen=True)
class CompactionPlan:
    """What a compaction would do, with its cost, before anything runs."""

    session_id: str
    upto_message_id: int  # the last message the summary stands for
    covered: int  # messages it stands for (those of an earlier summary included)
    new: int  # of those, messages no summary stood for until now
    kept: int  # messages the model reads after it
    replaced_tokens: int  # what the covered part takes in the prompt now
    kept_tokens: int  # the compacted prompt without the summary: re-read once
    speed: float | None  # this machine's measured prompt speed (tokens/s), if measured
    source: list[ChatMessage] = field(default_factory=list, repr=False)  # the summary's ask

    @property
    def reread_seconds(self) -> float | None:
        return self.kept_tokens / self.speed if self.speed else None

    def line(self) -> str:
        """The cost, in a line, e.g. "a summary replaces 1,798 tokens of 78 messages; the
        42 newest messages stay: reading them again (985 tokens) takes about 16.4 s here
        (60 tokens/s), and the summary's tokens a little more"."""
        took = (
            f" takes about {self.reread_seconds:,.1f} s here ({self.speed:,.0f} tokens/s), and "
            "the summary's tokens a little more"
            if self.reread_seconds is not None and self.speed
            else " is done once, with the summary's tokens"
        )
        return (
            f"a summary replaces {self.replaced_tokens:,} tokens of {self.covered} messages; "
            f"the {self.kept} newest messages stay: reading them again "
            f"({self.kept_tokens:,} tokens){took}"
        )


@dataclass(frozen=True)
class SummaryDraft:
    """The summary the model wrote, for the user to read, edit, accept or drop."""

    plan: CompactionPlan
    text: str
    tokens: int
    cancelled: bool = False


@dataclass(frozen=True)
class Compaction:
    """What an accepted compaction did."""

    summary: Summary
    branch_id: str  # the conversation as it was before, kept as a branch
    prompt: int  # tokens of the compacted prompt the context now holds
    decoded: int  # of those, decoded now (the rest was reused)
    snapshot: SnapshotWrite

    def line(self) -> str:
        saved = (
            f"KV saved ({self.snapshot.bytes:,} bytes)"
            if self.snapshot.bytes and not self.snapshot.error
            else f"KV not saved: {self.snapshot.error or 'nothing to save'}"
        )
        return (
            f"compacted: the summary stands for the messages up to #{self.summary.upto_message_id}"
            f"; read {self.decoded:,} of {self.prompt:,} tokens once; {saved}; the conversation "
            f"before it is the branch {self.branch_id}"
        )


class Compactor:
    """Compaction for the conversation service (see the module docstring). Composes the
    turn pipeline (the window, the hot context) and the session book (the branch before)."""

    def __init__(self, turns: TurnPipeline, book: SessionBook) -> None:
        self.turns = turns
        self.book = book

    # --- what the model sees ----------------------------------------------------------------

    def _engine(self) -> TokenEngine:
        engine = self.turns.host.load().token_level()
        if engine is None:
            raise KvchatError(
                "this engine takes whole messages (a server fits its own context): "
                "kvchat cannot compact its conversations"
            )
        return engine

    def _speed(self) -> float | None:
        probe = self.turns.host.probe
        threads = probe.best_threads("prefill") if probe is not None else None
        return probe.speed(threads, "prefill") if probe is not None and threads else None

    def view(self, session_id: str) -> WindowView:
        """What the model sees of the session now, before its next turn: the window its
        next prompt holds (without a new message), where it starts, and whether a turn
        would leave messages out."""
        store = self.turns.store
        session = store.get_session(session_id)
        engine = self._engine()
        history = store.messages(session_id)
        thinks = self.turns.host.reasoning_style.thinks
        head, chat, kept, summarized = self.turns.window(session, history, thinks)
        params = generation_params(self.turns.host.settings, session.settings, {})
        reserve = reply_reserve(params.max_tokens, engine.n_ctx)
        overflow = self.turns.host.settings.overflow
        if not chat:
            return WindowView(engine.n_ctx, 0, reserve, overflow=overflow)
        try:
            prompt, dropped = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        except KvchatError:
            prompt, dropped = [], len(chat) - 1
        return WindowView(
            n_ctx=engine.n_ctx,
            used=len(prompt),
            reserve=reserve,
            first_message_id=kept[dropped].id if dropped or summarized else None,
            left_out=summarized + dropped,
            summarized=summarized,
            next_drops=len(prompt) + NEXT_MESSAGE_ALLOWANCE + reserve > engine.n_ctx,
            overflow=overflow,
            summary=self._summary_text(session_id) if summarized else None,
        )

    def _summary_text(self, session_id: str) -> str | None:
        summary = self.turns.store.current_summary(session_id)
        return summary.text if summary is not None else None

    def loaded_view(self, session_id: str) -> WindowView | None:
        """:meth:`view` when the model is loaded already; None when it is not (or takes
        whole messages): a glance at the window never loads a model."""
        loaded = self.turns.host.loaded
        if loaded is None or loaded.token_level() is None:
            return None
        return self.view(session_id)

    def plan(self, session_id: str) -> CompactionPlan:
        """Which messages a summary would stand for now: all but the newest that fit half
        the context left after the reply reserve (at least the messages that would leave
        the window at the next turn; on demand, all but the last exchange when all fit)."""
        store = self.turns.store
        session = store.get_session(session_id)
        engine = self._engine()
        history = store.messages(session_id)
        summary = store.current_summary(session_id)
        visible, summarized = after_summary(history, summary)
        thinks = self.turns.host.reasoning_style.thinks
        head = self.turns.head(session)
        chat = self.turns.documents.chat(session_id, visible, thinks)
        params = generation_params(self.turns.host.settings, session.settings, {})
        reserve = reply_reserve(params.max_tokens, engine.n_ctx)
        keep_budget = int((engine.n_ctx - reserve) * KEEP_SHARE)
        try:
            _, cut = fit_window(
                engine.chat_tokens, head, chat, engine.n_ctx, engine.n_ctx - keep_budget
            )
        except KvchatError:
            cut = len(chat) - 1
        if cut == 0:
            cut = len(chat) - 2  # on demand: all but the last exchange
        while 0 < cut < len(chat) and visible[cut].role != "user":
            cut += 1  # the kept messages start with the user's
        if cut <= 0 or cut >= len(chat):
            raise KvchatError(
                f"nothing to compact: the model reads {len(visible)} messages"
                + (" after the summary" if summary else "")
                + "; a summary needs an earlier exchange to stand for"
            )
        covered = visible[:cut]
        current_head = with_summary(head, summary.text) if summary else head
        whole = len(engine.chat_tokens(current_head + chat))
        kept_tokens = len(engine.chat_tokens(head + chat[cut:]))
        replaced = whole - len(engine.chat_tokens(current_head + chat[cut:]))
        if summary is not None:
            replaced += engine.count_tokens(summary.text)
        source = self._source(engine, covered, summary.text if summary else None)
        return CompactionPlan(
            session_id=session_id,
            upto_message_id=covered[-1].id,
            covered=summarized + cut,
            new=cut,
            kept=len(chat) - cut,
            replaced_tokens=replaced,
            kept_tokens=kept_tokens,
            speed=self._speed(),
            source=source,
        )

    def _source(
        self, engine: TokenEngine, covered: list[Message], earlier: str | None
    ) -> list[ChatMessage]:
        """The ask for a summary of ``covered``, its oldest messages left out until it fits
        the context with room for the summary."""
        room = engine.n_ctx - SUMMARY_TOKENS - 1
        # No token is longer than a few characters: the newest messages whose text could
        # fit at all, before any rendering (an import of thousands of messages).
        start = len(covered) - 1  # the newest message always
        chars = len(earlier or "") + len(covered[start].content)
        while start > 0 and chars + len(covered[start - 1].content) <= room * CHARS_PER_TOKEN:
            start -= 1
            chars += len(covered[start].content)
        while True:
            ask = [
                {"role": "system", "content": SUMMARY_SYSTEM},
                {
                    "role": "user",
                    "content": "Summarize this conversation:\n\n"
                    + transcript(covered[start:], earlier),
                },
            ]
            if len(engine.chat_tokens(ask)) <= room or start >= len(covered) - 1:
                return ask
            start += max(1, (len(covered) - start) // 8)

    # --- the summary ------------------------------------------------------------------------

    def draft(
        self,
        plan: CompactionPlan,
        *,
        cancel: CancelCheck | None = None,
        on_token: TokenCallback | None = None,
    ) -> SummaryDraft:
        """The model's summary for ``plan`` (greedy, at most :data:`SUMMARY_TOKENS` and
        fewer than it replaces). The session's KV is saved and set aside first and is not
        changed: the summary is decoded in the context, for no session. Canceled (``cancel``)
        it is ``cancelled`` and its text is what came so far; nothing is stored either way."""
        engine = self._engine()
        turns = self.turns
        with turn_lock(turns.locks, plan.session_id):
            turns.upkeep.abandon()
            turns.host.tiers.spill()  # the session's KV: saved to disk and RAM, as it is
            prompt = engine.chat_tokens(plan.source)
            if len(prompt) + 1 >= engine.n_ctx:
                raise KvchatError("the messages to summarize do not fit the context")
            limit = max(
                1, min(SUMMARY_TOKENS, plan.replaced_tokens - 1, engine.n_ctx - len(prompt) - 1)
            )
            prefill = engine.prefill(prompt, cancel)
            stats = GenerationStats()
            pieces: list[str] = []
            if prefill.reused + prefill.decoded >= prefill.prompt:
                params = GenerationParams(temperature=0.0, max_tokens=limit, seed=0)
                for piece in engine.generate(params, stats, cancel):
                    pieces.append(piece)
                    if on_token is not None:
                        on_token(piece)
            else:
                stats.finish_reason = "cancelled"
        text = "".join(pieces).strip()
        return SummaryDraft(
            plan,
            text,
            engine.count_tokens(text) if text else 0,
            cancelled=stats.finish_reason == "cancelled",
        )

    def check(self, plan: CompactionPlan, text: str) -> str:
        """The summary as it will be stored, or one line why not (empty, not text, not
        shorter than what it replaces)."""
        text = check_text(text, "the summary").strip()
        if not text:
            raise KvchatError("the summary is empty: nothing was compacted")
        tokens = self._engine().count_tokens(text)
        if tokens >= plan.replaced_tokens:
            raise KvchatError(
                f"the summary ({tokens:,} tokens) is not shorter than the "
                f"{plan.replaced_tokens:,} tokens it replaces: shorten it; nothing was compacted"
            )
        return text

    def accept(
        self, plan: CompactionPlan, text: str, *, cancel: CancelCheck | None = None
    ) -> Compaction:
        """Compact the session with ``text`` as its summary (see the module docstring).

        The compacted prompt is read once, up to where the next user's words start; then
        the conversation before it is kept as a branch (a fork: its KV is shared), the
        summary stored (one row, whole) and the KV saved as the session's. Canceled or
        killed during the read, nothing was stored; failing after the branch and before the
        row, the branch is deleted again. Either way the session is as it was.
        """
        text = self.check(plan, text)
        store = self.turns.store
        engine = self._engine()
        if plan.upto_message_id not in {m.id for m in store.messages(plan.session_id)}:
            raise KvchatError("the conversation changed since the plan: compact it again")
        branch: Session | None = None
        try:
            with turn_lock(self.turns.locks, plan.session_id):
                target = self._compacted_prompt(plan, text, engine)
                tiers = self.turns.host.tiers
                self.turns.upkeep.abandon()
                # An empty context for no session (what it held is saved): the compacted
                # prompt is this engine's own reading, whatever the context held before.
                tiers.make_hot(plan.session_id, no_restore=True)
                read = engine.prefill(target, cancel)
                if read.reused + read.decoded < len(target):
                    engine.clear()
                    raise KvchatError("compaction canceled: nothing was changed")
                # The branch only now, next to the summary row: a kill during the read (the
                # long part) leaves no branch without its summary.
                branch = self.book.fork_holding_lock(plan.session_id)
                title = store.get_session(plan.session_id).title
                self.book.rename(branch.id, f"{BEFORE_LABEL}: {title}")
                summary = store.add_summary(
                    plan.session_id, plan.upto_message_id, text, plan.replaced_tokens
                )
                tiers.mark_hot(plan.session_id)
                tiers.mark_dirty()
                snapshot = tiers.save_hot()
        except BaseException:
            if branch is not None:
                try:
                    self.book.delete(branch.id)
                except KvchatError:
                    pass
            raise
        return Compaction(summary, branch.id, len(target), read.decoded, snapshot)

    def _compacted_prompt(self, plan: CompactionPlan, text: str, engine: TokenEngine) -> list[int]:
        """What the context holds after compacting: the compacted prompt up to where the
        next user's words start (so the next turn decodes only its own message)."""
        store = self.turns.store
        session = store.get_session(plan.session_id)
        thinks = self.turns.host.reasoning_style.thinks
        kept = [m for m in store.messages(plan.session_id) if m.id > plan.upto_message_id]
        head = with_summary(self.turns.head(session), text)
        chat = self.turns.documents.chat(plan.session_id, kept, thinks)
        params = generation_params(self.turns.host.settings, session.settings, {})
        reserve = reply_reserve(params.max_tokens, engine.n_ctx)
        prompt, _ = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        return settle_target(engine.chat_tokens, head + chat, prompt, prompt, engine.n_ctx)
