"""What a turn reports: token counts, restore, timing, the window, the snapshot write.

These are the service's result types, shared by the TUI, the CLI's ``--json`` and the
benchmark; ``kvchat.service.chat`` re-exports them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvchat.engine import GenerationParams, GenerationStats, PrefillResult
from kvchat.errors import KvchatError
from kvchat.kvcache import RestoreResult
from kvchat.kvcache.tiers import SnapshotWrite
from kvchat.limits import sampling_problem
from kvchat.service.documents import AttachedDocument
from kvchat.store.figures_sql import MessageFigures

if TYPE_CHECKING:
    from kvchat.config import Settings

TokenCallback = Callable[[str], None]


class UnansweredMessage(KvchatError):
    """A turn failed after the user's message was stored: the message stays, unanswered."""

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"{reason}; your message is saved in session {session_id} without a reply")
        self.session_id = session_id
        self.reason = reason


class MessageRefused(KvchatError):
    """The user's message was not sent: ``post`` could not store it (``busy``: another
    process runs a turn on the session), or its turn found it cannot fit the context and
    deleted it again, unanswered. A UI gives ``text`` back to the user to edit or resend."""

    def __init__(self, text: str, reason: str, *, busy: bool = False) -> None:
        super().__init__(f"{reason}; the message was not sent")
        self.text = text
        self.reason = reason
        self.busy = busy


# Sampling settings a session may override.
SESSION_SETTINGS = ("temperature", "top_p", "max_tokens", "seed")
# A session's switches: "think" (true, false; unset: the model's default) turns a thinking
# model's reasoning on or off where its template can; "tools_off" lists the tools turned
# off for the session and "tools_always" those the user let run in it without asking (each
# a list of qualified tool names, kept with the session, its exports and its bundles).
SESSION_SWITCHES = ("think", "tools_off", "tools_always")
TOOL_SWITCHES = ("tools_off", "tools_always")
MAX_SWITCHED_TOOLS = 512
MAX_TOOL_NAME_CHARS = 300  # server.tool: a server name and MCP's 128-character tool name


def session_tools(settings: Mapping[str, Any], switch: str) -> frozenset[str]:
    """The tool names a session's ``switch`` (one of :data:`TOOL_SWITCHES`) lists."""
    value = settings.get(switch)
    if not isinstance(value, list):
        return frozenset()
    return frozenset(name for name in value if isinstance(name, str))


def tool_switch_problem(switch: str, value: object) -> str | None:
    """Why ``value`` cannot be a session's ``switch`` (None when it can): a list of at most
    :data:`MAX_SWITCHED_TOOLS` printable names of 1 to :data:`MAX_TOOL_NAME_CHARS`."""
    if not isinstance(value, list) or len(value) > MAX_SWITCHED_TOOLS:
        return f"{switch} is a list of at most {MAX_SWITCHED_TOOLS} tool names"
    for name in value:
        if not (
            isinstance(name, str) and 0 < len(name) <= MAX_TOOL_NAME_CHARS and name.isprintable()
        ):
            return f"{switch} holds tool names of 1-{MAX_TOOL_NAME_CHARS} printable characters"
    return None


def session_think(settings: Mapping[str, Any]) -> bool | None:
    """The session's thinking choice (None: the template's default)."""
    value = settings.get("think")
    return value if isinstance(value, bool) else None


def generation_params(
    settings: Settings, session: Mapping[str, Any], overrides: Mapping[str, Any]
) -> GenerationParams:
    """Sampling for one turn: the call's overrides over the session's over the settings'.

    An unset seed is a new random one, so "no seed" means a different reply each time.
    ``grammar`` (an override only): a GBNF grammar the reply must follow.
    """
    overrides = dict(overrides)
    grammar = overrides.pop("grammar", None)
    for name, value in overrides.items():
        problem = None if value is None else sampling_problem(name, value)
        if problem:
            raise KvchatError(problem)
    values: dict[str, Any] = {key: getattr(settings, key) for key in SESSION_SETTINGS}
    values.update({k: v for k, v in session.items() if k in SESSION_SETTINGS})
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - set(SESSION_SETTINGS)
    if unknown:
        raise TypeError(f"unknown generation settings: {unknown}")
    if values["seed"] is None:
        values["seed"] = secrets.randbits(31)
    return GenerationParams(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        max_tokens=int(values["max_tokens"]),
        seed=int(values["seed"]),
        grammar=None if grammar is None else str(grammar),
    )


@dataclass
class TokenCounts:
    prompt: int = 0
    reused: int = 0
    decoded: int = 0
    generated: int = 0
    # Tokens the context held after the reply that the next turn's prompt renders
    # differently (a thinking model's template dropping the reasoning, say): the settle
    # re-reads them while the user reads, or the next turn decodes them.
    rerendered: int = 0
    # Counts the engine had no figure for (an OpenAI-compatible server that reports none):
    # "not reported" in the summary and null in JSON, never a 0 that was not counted.
    unreported: tuple[str, ...] = ()

    def value(self, name: str) -> int | None:
        """The count ``name``, or None when it was not reported."""
        return None if name in self.unreported else int(getattr(self, name))

    def shown(self, name: str) -> str:
        """The count ``name`` for a person: "1,234", or "not reported"."""
        value = self.value(name)
        return "not reported" if value is None else f"{value:,}"


@dataclass
class TurnReport:
    """Everything a UI shows about one turn; ``to_json`` is the CLI's ``--json`` object."""

    session_id: str
    reply: str
    tokens: TokenCounts
    restore: RestoreResult
    ttft_ms: float | None
    tokens_per_s: float | None
    finish_reason: str
    message_id: int | None = None
    dropped_messages: int = 0
    snapshot: SnapshotWrite = field(default_factory=SnapshotWrite)
    # Context overflow on this turn: tokens and messages moved out of the KV by a shift, or
    # why the kept window was re-read instead (see TurnPipeline._shift_window).
    shifted_tokens: int = 0
    shifted_messages: int = 0
    window_note: str | None = None
    # The reply was generated (it is in ``reply``) but could not be stored: why, in one line.
    reply_error: str | None = None
    # With reply_error: characters of the reply the database holds all the same (its copy
    # saved while it streamed, marked partial), or None when it holds none of it.
    stored_part: int | None = None
    # A thinking model's reasoning before the answer in ``reply`` ("" when none).
    reasoning: str = ""
    # The OpenAI-compatible server that ran the turn (None: kvchat's own engine or a
    # llama-server's slots): the counts are its figures and its KV is not kvchat's.
    remote: str | None = None
    # Which of the server's fields the counts came from ("usage", "timings", …; "": none).
    remote_figures: str = ""
    # The server's turn, in a line: why its reply was cut off (the part shown is stored,
    # partial), figures it sent that are not shown; None: nothing to say.
    remote_note: str | None = None
    # The documents the session's prompt holds (attachments), with their tokens.
    documents: list[AttachedDocument] = field(default_factory=list)
    # What the model sees of the conversation after this turn (gauge, divider, warning).
    view: WindowView | None = None
    # The reply as the model wrote it (markup a reasoning split takes out included: a
    # harmony call's header), for reading its tool calls; "" where not kept.
    written: str = ""

    @classmethod
    def of_run(
        cls,
        session_id: str,
        reply: str,
        restore: RestoreResult,
        prefill: PrefillResult,
        stats: GenerationStats,
        **extra: Any,
    ) -> TurnReport:
        """The report of a prefill then a generation (``extra``: the window's fields)."""
        return cls(
            session_id=session_id,
            reply=reply,
            tokens=TokenCounts(prefill.prompt, prefill.reused, prefill.decoded, stats.generated),
            restore=restore,
            ttft_ms=stats.ttft_ms,
            tokens_per_s=stats.tokens_per_s,
            finish_reason=stats.finish_reason,
            **extra,
        )

    @property
    def partial(self) -> bool:
        return self.finish_reason in ("cancelled", "context")

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "reply": self.reply,
            "reasoning": self.reasoning,
            "finish_reason": self.finish_reason,
            "message_id": self.message_id,
            "reply_error": self.reply_error,
            "tokens": {
                name: self.tokens.value(name)
                for name in ("prompt", "reused", "decoded", "generated", "rerendered")
            },
            "remote": None
            if self.remote is None
            else {
                "url": self.remote,
                "figures": self.remote_figures or None,
                "note": self.remote_note,
            },
            "restore": self.restore.to_json(),
            "timing": {
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
                "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            },
            "documents": [d.to_json() for d in self.documents],
            "window": {
                "dropped_messages": self.dropped_messages,
                "shifted_messages": self.shifted_messages,
                "shifted_tokens": self.shifted_tokens,
                "note": self.window_note,
                **(self.view.to_json() if self.view is not None else {}),
            },
            "snapshot": {
                "bytes": self.snapshot.bytes,
                "written": self.snapshot.written,
                "chunks_written": self.snapshot.chunks_written,
                "chunks_shared": self.snapshot.chunks_shared,
                "checkpoints_written": self.snapshot.checkpoints_written,
                "whole_reason": self.snapshot.whole_reason,
                "ms": round(self.snapshot.ms, 2),
                "error": self.snapshot.error,
            },
        }

    def summary(self) -> str:
        """One line for a status bar or stderr, e.g. "restored 312 tokens from disk in 4 ms · …"."""
        r = self.restore
        if self.remote is not None:
            t = self.tokens
            head = (
                f"{self.remote}: prompt {t.shown('prompt')} tokens, reused {t.shown('reused')}"
                + (" (the server's figures)" if self.remote_figures else "")
            )
        elif r.source == "hot":
            head = f"hot context, reused {self.tokens.reused:,} tokens"
        elif r.source in ("ram", "disk", "server"):
            head = f"restored {r.tokens:,} tokens from {r.source} in {r.ms:,.0f} ms"
            if self.tokens.reused < r.tokens:  # the prompt left the rest: say what served
                head += f", reused {self.tokens.reused:,}"
        else:
            head = f"full prefill: {r.reason}"
        parts = [head, f"decoded {self.tokens.shown('decoded')}"]
        if self.ttft_ms is not None:
            parts.append(f"first token {self.ttft_ms:,.0f} ms")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.shifted_tokens:
            parts.append(
                f"KV shift: {self.shifted_messages} old messages ({self.shifted_tokens:,} tokens) "
                f"left the window, {self.dropped_messages} out in all (text kept)"
            )
        elif self.dropped_messages:
            parts.append(f"{self.dropped_messages} old messages left the window")
        if self.reasoning:
            parts.append(f"reasoned {len(self.reasoning):,} characters")
        if self.tokens.rerendered and self.reasoning:
            parts.append(f"template re-renders {self.tokens.rerendered:,} tokens")
        if self.window_note:
            parts.append(self.window_note)
        if self.snapshot.whole_reason:
            parts.append(f"KV saved whole: {self.snapshot.whole_reason}")
        if self.remote is not None:
            parts.append("KV on the server, not kvchat's: no snapshot")
        if self.remote_note:
            parts.append(self.remote_note)
        if self.finish_reason == "cancelled" and not self.remote_note:
            parts.append("cancelled")
        elif self.finish_reason == "length":
            parts.append("stopped at the token limit")
        return " · ".join(parts)


def reading_phrase(done: int, total: int, seconds: float) -> str:
    """How far the prompt's read is, e.g. "reading the prompt · 2,048 / 5,727 tokens ·
    ~35 s left" (the estimate once some of it was read)."""
    text = f"reading the prompt · {done:,} / {total:,} tokens"
    if done > 0 and seconds > 0 and total > done:
        left = (total - done) * seconds / done
        text += f" · ~{left:,.0f} s left" if left < 120 else f" · ~{left / 60:,.0f} min left"
    return text


# Tokens the warning allows for the next message: the next turn would leave messages out
# of the window when the context holds more than n_ctx minus the reply reserve and this.
NEXT_MESSAGE_ALLOWANCE = 64


@dataclass
class WindowView:
    """What the model sees of a conversation: the context's use (the status bar's gauge),
    where the window starts (the conversation's divider), and whether the next turn would
    leave messages out (a warning)."""

    n_ctx: int = 0
    used: int = 0  # tokens the conversation takes in the context (prompt and reply)
    reserve: int = 0  # kept free for a reply
    # The first message inside the window, when earlier ones are not read (None: all are).
    first_message_id: int | None = None
    left_out: int = 0  # messages before it (kept in SQLite, not read)
    summarized: int = 0  # of those, how many a compaction summary stands for
    next_drops: bool = False  # the next turn would leave messages out of the window
    overflow: str = "compact"  # the setting: what happens then
    summary: str | None = None  # the summary the model reads (None: no compaction)

    def gauge(self) -> str:
        """The status bar's gauge, e.g. "ctx 1,234/2,048 (+512 reply)"."""
        if not self.n_ctx:
            return ""
        mark = " !" if self.next_drops else ""
        return f"ctx {self.used:,}/{self.n_ctx:,} (+{self.reserve:,} reply){mark}"

    def divider(self) -> str | None:
        """The line drawn above :attr:`first_message_id` (None when the model reads all)."""
        if self.first_message_id is None:
            return None
        unread = self.left_out - self.summarized
        if self.summarized and not unread:
            return (
                f"the model sees from here, with a summary of the {self.summarized} "
                "earlier messages (kept, not read)"
            )
        line = f"the model sees from here; {self.left_out} earlier messages are kept but not read"
        if self.summarized:
            line += f" ({self.summarized} of them summarized)"
        return line

    def warning(self) -> str | None:
        """Said before the next turn would leave messages out (None: it would not)."""
        if not self.next_drops:
            return None
        if self.overflow == "compact":
            return (
                "the context is nearly full: the next turn leaves the oldest messages out "
                "unless you compact them (/compact writes a summary to read instead)"
            )
        return "the context is nearly full: the next turn leaves the oldest messages out"

    def to_json(self) -> dict[str, Any]:
        return {
            "n_ctx": self.n_ctx,
            "used": self.used,
            "reserve": self.reserve,
            "first_message_id": self.first_message_id,
            "left_out": self.left_out,
            "summarized": self.summarized,
            "next_drops": self.next_drops,
        }


@dataclass
class WindowShift:
    """What a turn did when messages left the window: a KV shift, or a note why not."""

    tokens: int = 0
    messages: int = 0
    note: str | None = None


@dataclass
class Housekeeping:
    """What the work after a reply did: the settle (tokens re-decoded) and the snapshot."""

    settled: int = 0
    settle_ms: float = 0.0
    snapshot: SnapshotWrite | None = None  # None: not written (yet)
    # False: it yielded to a new message (or the session was busy); the rest is pending.
    finished: bool = True
    note: str | None = None
    # The title the model gave the session after its first reply (None: none made).
    title: str | None = None


# --- a reply's figures, kept with it (kvchat.store.figures_sql) ---------------------------


def restore_words(restore: RestoreResult) -> str:
    """How a turn's KV got into the context, in words."""
    if restore.source == "hot":
        return "hot context"
    if restore.source in ("ram", "disk", "server"):
        return f"restored {restore.tokens:,} tokens from {restore.source} in {restore.ms:,.0f} ms"
    return f"full prefill: {restore.reason}" if restore.reason else "full prefill"


def figures_of(report: TurnReport, model: str) -> MessageFigures:
    """What is kept of ``report`` with its reply; ``model``: the model that wrote it, as the
    user knows it. Seconds: to the first token, then the tokens at their rate."""
    tokens = report.tokens
    generated = tokens.value("generated")
    seconds = None
    if report.ttft_ms is not None and report.tokens_per_s and generated is not None:
        seconds = report.ttft_ms / 1000 + generated / report.tokens_per_s
    return MessageFigures(
        model=model,
        prompt_tokens=tokens.value("prompt"),
        reused=tokens.value("reused"),
        decoded=tokens.value("decoded"),
        generated=generated,
        ttft_ms=report.ttft_ms,
        tokens_per_s=report.tokens_per_s,
        seconds=seconds,
        kv=report.remote or restore_words(report.restore),
    )


def figure_lines(figures: MessageFigures) -> list[str]:
    """A kept reply's figures, one per line (the app's F3 after a restart)."""

    def count(value: int | None) -> str:
        return "not reported" if value is None else f"{value:,}"

    lines = [f"Model: {figures.model or 'not recorded'}"]
    made = f"Generated: {count(figures.generated)} tokens"
    if figures.tokens_per_s:
        made += f" at {figures.tokens_per_s:,.1f} tok/s"
    if figures.seconds is not None:
        made += f" in {figures.seconds:,.1f} s"
    lines.append(made)
    if figures.ttft_ms is not None:
        lines.append(f"First token after: {figures.ttft_ms:,.0f} ms")
    lines.append(
        f"Prompt: {count(figures.prompt_tokens)} tokens ({count(figures.reused)} reused, "
        f"{count(figures.decoded)} decoded)"
    )
    if figures.kv:
        lines.append(f"KV: {figures.kv}")
    return lines
