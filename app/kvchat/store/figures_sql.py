"""Each reply's figures, kept with it (migration m024_message_figures): which model wrote
it, its prompt's counts, tokens generated, time to the first token, tok/s, seconds taken and
how its KV got into the context. A message's figures go with it (ON DELETE CASCADE).

And the token counts of messages that came without one (imported): counted once a model
is loaded, and stored in the message's own ``token_count``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvchat.store.connection import SqlBase, now

# What a figure read back must be to be shown: a count kvchat could have counted, a time
# it could have taken (anything else, written by something not kvchat, reads as unknown).
MAX_COUNT = 1 << 40
MAX_SECONDS = 1e7


@dataclass(frozen=True)
class MessageFigures:
    """A reply's figures; None: not counted (a server that reports none) or not sane."""

    model: str = ""
    prompt_tokens: int | None = None
    reused: int | None = None
    decoded: int | None = None
    generated: int | None = None
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    seconds: float | None = None
    kv: str = ""  # how the KV got into the context, in words ("restored … from disk …")
    recorded: str = ""


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and 0 <= value < MAX_COUNT else None


def _amount(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value) and 0 <= value < MAX_SECONDS:
        return float(value)
    return None


def _text(value: Any, limit: int = 300) -> str:
    return value[:limit] if isinstance(value, str) else ""


class FiguresSql(SqlBase):
    """Record a reply's figures; read them back; messages without a token count."""

    def uncounted_messages(self, session_id: str, limit: int) -> list[tuple[int, str]]:
        """Up to ``limit`` of the session's messages with text and no token count (imported
        ones), oldest first: (id, text)."""
        rows = self._rows(
            "SELECT id, content FROM messages WHERE session_id = ? AND token_count = 0"
            " AND content != '' ORDER BY id LIMIT ?",
            (session_id, max(0, limit)),
        )
        return [(r["id"], r["content"]) for r in rows if isinstance(r["content"], str)]

    def keep_token_counts(self, session_id: str, counts: dict[int, int]) -> None:
        """Store ``counts`` (message id → tokens) for messages that still have none; the
        session's token sum follows (its triggers) and its change stamp moves, so every list
        shows the new figure; its ``updated`` time stays."""
        if not counts:
            return
        with self._tx() as conn:
            conn.executemany(
                "UPDATE messages SET token_count = ? WHERE id = ? AND session_id = ?"
                " AND token_count = 0",
                [(n, message_id, session_id) for message_id, n in counts.items() if n > 0],
            )
            conn.execute("UPDATE sessions SET updated = updated WHERE id = ?", (session_id,))

    def record_figures(self, message_id: int, figures: MessageFigures) -> None:
        """Keep ``figures`` for message ``message_id`` (replacing any it had: a regenerated
        or continued reply keeps its latest turn's)."""
        with self._tx() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO message_figures (message_id, model, prompt_tokens,"
                " reused, decoded, generated, ttft_ms, tokens_per_s, seconds, kv, recorded)"
                " SELECT id, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM messages WHERE id = ?",
                (
                    figures.model,
                    figures.prompt_tokens,
                    figures.reused,
                    figures.decoded,
                    figures.generated,
                    figures.ttft_ms,
                    figures.tokens_per_s,
                    figures.seconds,
                    figures.kv,
                    now(),
                    message_id,
                ),
            )

    def message_figures(self, message_id: int) -> MessageFigures | None:
        """The figures kept for message ``message_id``; None when none were."""
        rows = self._rows("SELECT * FROM message_figures WHERE message_id = ?", (message_id,))
        if not rows:
            return None
        r = rows[0]
        return MessageFigures(
            model=_text(r["model"]),
            prompt_tokens=_count(r["prompt_tokens"]),
            reused=_count(r["reused"]),
            decoded=_count(r["decoded"]),
            generated=_count(r["generated"]),
            ttft_ms=_amount(r["ttft_ms"]),
            tokens_per_s=_amount(r["tokens_per_s"]),
            seconds=_amount(r["seconds"]),
            kv=_text(r["kv"]),
            recorded=_text(r["recorded"], 40),
        )
