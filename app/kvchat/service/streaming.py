"""Generating a reply: tokens streamed to the caller, the text kept as it streams."""

from __future__ import annotations

import time

from kvchat.engine import CancelCheck, Engine, GenerationParams, GenerationStats, PrefillResult
from kvchat.errors import KvchatError
from kvchat.service.reasoning import NO_REASONING, ReasoningStyle, split_reasoning
from kvchat.service.reports import TokenCallback
from kvchat.store import Store

# A streaming reply is stored (partial) after this long, then updated this often.
STREAM_SAVE_EVERY_S = 1.0


def stream_reply(
    engine: Engine,
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
    """Stores a streaming reply as a partial message after its first second, then updates it
    every second (a convenience: a store that refuses is skipped, the final commit retries)."""

    def __init__(
        self,
        store: Store,
        session_id: str,
        every_s: float = STREAM_SAVE_EVERY_S,
        style: ReasoningStyle = NO_REASONING,
    ):
        self.store = store
        self.session_id = session_id
        self.every_s = every_s
        self.style = style  # the reasoning is stored apart from the answer as it streams
        self.message_id: int | None = None
        self.stored_chars = 0  # of the reply, as the database holds it now
        self._next = time.monotonic() + every_s

    def tick(self, pieces: list[str], generated: int) -> None:
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        text = "".join(pieces)
        if not text.strip():
            return
        reasoning, answer = split_reasoning(text, self.style)
        try:
            if self.message_id is None:
                self.message_id = self.store.add_message(
                    self.session_id,
                    "assistant",
                    answer,
                    token_count=generated,
                    partial=True,
                    reasoning=reasoning,
                ).id
            else:
                self.store.update_message(
                    self.message_id, answer, True, token_count=generated, reasoning=reasoning
                )
            self.stored_chars = len(answer)
        except KvchatError:
            pass
