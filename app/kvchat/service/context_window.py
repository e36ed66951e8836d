"""Which messages fit the context, and how old ones leave the KV: pure functions.

Everything here works on token ids from a ``render(messages) -> tokens`` callable (an
engine's ``chat_tokens``, or a fake in tests), so it is testable without a model. The
service applies the results to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvchat.engine import common_prefix
from kvchat.errors import KvchatError
from kvchat.store import Message
from kvchat.store.summaries_sql import Summary

ChatMessage = dict[str, str]
Render = Callable[[Sequence[ChatMessage]], list[int]]


# Tokens at the end of a turn's prompt that the next turn's prompt may render otherwise (a
# generation prompt that opens a think block the history does not show).
REWRITTEN_TAIL = 16


def reply_reserve(max_tokens: int, n_ctx: int) -> int:
    """The context a turn keeps free for its reply: the reply's token limit, at most a
    quarter of the context."""
    return min(max_tokens, n_ctx // 4)


def system_head(system: str | None) -> list[ChatMessage]:
    """The system prompt as the first message of every window (none when empty)."""
    return [{"role": "system", "content": system}] if system else []


# How a compaction's summary is introduced in the system message.
SUMMARY_HEADER = "Summary of the earlier conversation:"


def with_summary(head: list[ChatMessage], text: str) -> list[ChatMessage]:
    """[system prompt, documents, summary]: the summary after the system message's text (a
    system message of its own when the session has none)."""
    block = f"{SUMMARY_HEADER}\n{text}"
    if head:
        first = dict(head[0])
        first["content"] = f"{first['content']}\n\n{block}"
        return [first, *head[1:]]
    return [{"role": "system", "content": block}]


def after_summary(history: Sequence[Message], summary: Summary | None) -> tuple[list[Message], int]:
    """The messages a prompt renders after ``summary`` (all without one), and how many it
    stands for."""
    if summary is None:
        return list(history), 0
    kept = [m for m in history if m.id > summary.upto_message_id]
    return kept, len(history) - len(kept)


def fit_window(
    render: Render, head: list[ChatMessage], chat: list[ChatMessage], n_ctx: int, reserve: int
) -> tuple[list[int], int]:
    """Prompt tokens for the newest messages that fit ``n_ctx`` minus ``reserve``.

    ``head`` (the system prompt) always stays; the oldest messages leave the window
    first (their text stays in SQLite), and a window never starts with a reply. Returns
    the tokens and how many messages were left out.

    The window is found from the newest message back: windows of 1, 2, 4, … messages,
    then a bisection between the last that fit and the first that did not, so a history
    of thousands of messages (an imported one) costs a few renders of about the window's
    size, not one render of the whole history per message left out (that took hours at
    5,000 messages). It relies on a window's tokens not growing when a message leaves it.
    """
    budget = n_ctx - reserve
    count = len(chat)
    rendered: dict[int, list[int]] = {}

    def fits(kept: int) -> bool:
        """Whether the newest ``kept`` messages fit (their tokens kept for the answer)."""
        tokens = render(head + chat[count - kept :])
        if len(tokens) > budget:
            return False
        rendered[kept] = tokens
        return True

    fitting, trying = 0, 1  # newest messages known to fit / to try next
    while trying <= count and fits(trying):
        fitting, trying = trying, trying * 2
    too_many = min(trying, count + 1)  # known not to fit (or more than there are)
    while too_many - fitting > 1:
        middle = (fitting + too_many) // 2
        if fits(middle):
            fitting = middle
        else:
            too_many = middle
    dropped = count - fitting
    while dropped < count and chat[dropped]["role"] == "assistant":
        dropped += 1  # a window never starts with a reply: it loses that one too
    if dropped >= count:
        raise KvchatError(
            f"the last message does not fit the context (n_ctx={n_ctx}); shorten it or raise n_ctx"
        )
    kept = count - dropped
    return rendered.get(kept) or render(head + chat[dropped:]), dropped


@dataclass(frozen=True)
class ShiftPlan:
    """Positions ``[start, end)`` of the held KV to drop so it becomes the new prompt's.

    ``start`` is where the held tokens and the prompt part; ``end == start`` when the
    held tokens do not hold the messages that left the window as one block.
    """

    start: int
    end: int
    messages: int = 0  # messages that leave the KV with the block

    @property
    def found(self) -> bool:
        return self.end > self.start


def plan_shift(
    render: Render,
    head: list[ChatMessage],
    chat: list[ChatMessage],
    held: Sequence[int],
    prompt: Sequence[int],
    dropped: int,
) -> ShiftPlan | None:
    """When old messages left the window: the block of held KV to shift out, or None.

    The context holds the rendering of some earlier window (messages ``start:``), the
    new prompt renders messages ``dropped:``. In token space the new prompt is the held
    rendering minus one block ``[p0, p1)`` (the messages ``start:dropped``, aligned on
    the template's message boundaries): ``p0`` is the common prefix (the system prompt
    and the first tokens stay) and ``p1 = p0 + (held - prompt)``, checked to line up on
    both sides. None when nothing left the window or the context already holds this
    window (or a prefix of it).
    """
    if not dropped or not held:
        return None
    p0 = common_prefix(held, prompt)
    if p0 >= len(prompt) or p0 >= len(held):
        return None
    for start in range(dropped - 1, -1, -1):  # the most recent window first
        if start and chat[start]["role"] == "assistant":
            continue  # fit_window never starts a window with a reply
        rendered = render(head + chat[start:])
        p1 = p0 + len(rendered) - len(prompt)
        if p1 <= p0 or p1 >= len(held):
            continue
        if rendered[:p0] != list(prompt[:p0]) or rendered[p1:] != list(prompt[p0:]):
            continue  # the dropped messages are not one block of tokens here
        if list(held[:p1]) != rendered[:p1] or held[p1] != rendered[p1]:
            continue  # the context does not hold this rendering
        return ShiftPlan(p0, p1, dropped - start)
    return ShiftPlan(p0, p0)


def settle_target(
    render: Render, chat: list[ChatMessage], prompt: Sequence[int], held: list[int], n_ctx: int
) -> list[int]:
    """What the context should hold after a reply: the next turn's prompt up to the user's words.

    That is what the template puts between the reply and the next user's words (e.g.
    ``<|im_end|>\\n<|im_start|>user\\n``), found as the common prefix of the prompts for
    two different next messages. A template may end its generation prompt with what it
    does not write before a reply in the history (an opening ``<think>``): up to
    :data:`REWRITTEN_TAIL` tokens of the prompt may differ. When the template re-renders
    earlier history differently, ``held`` (what the context holds) is kept as it is.
    """
    first = render(chat + [{"role": "user", "content": "A"}])
    second = render(chat + [{"role": "user", "content": "B"}])
    shared = common_prefix(first, second)
    same = common_prefix(first, prompt)
    if len(prompt) - same <= REWRITTEN_TAIL and len(prompt) < shared < n_ctx - 1:
        return first[:shared]
    return held
