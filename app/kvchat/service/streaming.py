"""Generating a reply: tokens streamed to the caller, the text kept as it streams."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvchat.engine import CancelCheck, GenerationParams, GenerationStats, PrefillResult, TokenEngine
from kvchat.errors import KvchatError
from kvchat.service.reasoning import NO_REASONING, ReasoningStyle, split_reasoning
from kvchat.service.reports import TokenCallback
from kvchat.store import Store
from kvchat.text import one_line

# A streaming reply is stored (partial) after this long, then updated this often: what a
# kill loses of what was shown is the tokens of at most this long (each save is one small
# transaction; measured in tests/e2e/durability).
STREAM_SAVE_EVERY_S = 0.25
# The finish reason a reply is stored with while it streams: the final commit replaces it,
# so a reply still marked so was cut off when the kvchat writing it ended (a kill, a crash).
STREAMING = "streaming"
# How long one save of a streaming reply waits for another process's write lock.
SAVE_WAIT_S = 0.2
# A save that failed is tried again after this long, doubling up to RETRY_MAX_S (a database
# held for long costs the reply at most SAVE_WAIT_S every RETRY_MAX_S).
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
# Saves that have failed for this long are said (see StreamSaver).
SAVE_TROUBLE_AFTER_S = 5.0

# Told, on the engine thread, that the streaming reply is not being saved (one line), or
# that it is again (None).
SaveTrouble = Callable[[str | None], None]


def stream_reply(
    engine: TokenEngine,
    prefill: PrefillResult,
    params: GenerationParams,
    stats: GenerationStats,
    cancel: CancelCheck | None,
    on_token: TokenCallback | None,
    saver: StreamSaver | None = None,
) -> str:
    """Generate after ``prefill`` and return the reply, streamed to ``on_token`` (and
    ``saver``) as it comes; a prefill cut short is a cancelled turn with no reply."""
    if prefill.reused + prefill.decoded < prefill.prompt:
        stats.finish_reason = "cancelled"
        return ""
    pieces: list[str] = []
    for piece in engine.generate(params, stats, cancel):
        pieces.append(piece)
        if on_token is not None:
            on_token(piece)
        if saver is not None:
            saver.tick(pieces, stats.generated)
    return "".join(pieces)


class StreamSaver:
    """Stores a streaming reply as a partial message (finish reason :data:`STREAMING`) after
    its first ``every_s``, then updates it as often, between tokens, on the thread that
    generates them.

    A save never holds the reply up: it waits at most :data:`SAVE_WAIT_S` for the database
    (another process may hold its write lock: an import, a second kvchat, a shell), and one
    that fails is tried again, sooner at first (:data:`RETRY_FIRST_S`, doubling up to
    :data:`RETRY_MAX_S`), with the whole reply so far: the stored text is always the text
    shown up to some moment, and it catches up at the first save that goes through. While
    saves have failed for :attr:`trouble_after_s`, ``on_trouble`` gets one line saying so
    (again as it goes on), and None once a save went through again. The final commit after
    the reply (see ``TurnPipeline._store_reply``) waits as long as any write."""

    def __init__(
        self,
        store: Store,
        session_id: str,
        every_s: float = STREAM_SAVE_EVERY_S,
        style: ReasoningStyle = NO_REASONING,
        on_trouble: SaveTrouble | None = None,
        trouble_after_s: float = SAVE_TROUBLE_AFTER_S,
    ):
        self.store = store
        self.session_id = session_id
        self.every_s = every_s
        self.style = style  # the reasoning is stored apart from the answer as it streams
        self.on_trouble = on_trouble
        self.trouble_after_s = trouble_after_s
        self.message_id: int | None = None
        self.stored_chars = 0  # of the reply, as the database holds it now
        self._next = time.monotonic() + every_s
        self.failing_since: float | None = None  # when saves started failing (monotonic)
        self.failures = 0  # saves that failed in a row
        self.error: str | None = None  # why the last save failed
        self.trouble: str | None = None  # the line given to on_trouble (None: none now)

    def tick(self, pieces: list[str], generated: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        text = "".join(pieces)
        if not text.strip():
            return
        reasoning, answer = split_reasoning(text, self.style)
        try:
            with self.store.waiting_at_most(SAVE_WAIT_S):
                if self.message_id is None:
                    self.message_id = self.store.add_message(
                        self.session_id,
                        "assistant",
                        answer,
                        token_count=generated,
                        partial=True,
                        finish_reason=STREAMING,
                        reasoning=reasoning,
                    ).id
                else:
                    self.store.update_message(
                        self.message_id,
                        answer,
                        True,
                        token_count=generated,
                        finish_reason=STREAMING,
                        reasoning=reasoning,
                    )
        except KvchatError as exc:
            self._failed(exc, len(answer))
            return
        self.stored_chars = len(answer)
        self.failures, self.failing_since, self.error = 0, None, None
        if self.trouble is not None:
            self.trouble = None
            self.tell(None)

    def _failed(self, exc: KvchatError, shown: int) -> None:
        """A save failed: try again soon (sooner than ``every_s`` at first), and say so once
        saves have failed for ``trouble_after_s``."""
        now = time.monotonic()
        self.failures += 1
        self.error = one_line(str(exc))
        if self.failing_since is None:
            self.failing_since = now
        self._next = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self.failures - 1))
        failing_for = now - self.failing_since
        if failing_for < self.trouble_after_s:
            return
        self.trouble = (
            f"the reply is not being saved ({failing_for:.0f} s, trying again; "
            f"{self.stored_chars:,} of {shown:,} characters stored): {self.error}"
        )
        self.tell(self.trouble)

    def tell(self, line: str | None) -> None:
        if self.on_trouble is not None:
            self.on_trouble(line)
