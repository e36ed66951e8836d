"""Window fitting and the KV shift plan, without a model: a fake ChatML-ish renderer whose
tokens are characters, so every position can be checked by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvchat.errors import KvchatError
from kvchat.service.context_window import (
    ShiftPlan,
    fit_window,
    plan_shift,
    settle_target,
    system_head,
)

Chat = list[dict[str, str]]


def turn(message: dict[str, str]) -> str:
    return f"<{message['role']}>{message['content']}</>"


def render(messages: Sequence[dict[str, str]]) -> list[int]:
    """The template over ``messages`` plus the assistant's opening, one token per character."""
    return [ord(c) for c in "".join(turn(m) for m in messages) + "<assistant>"]


def boundary(messages: Sequence[dict[str, str]]) -> int:
    """Where the message after ``messages`` starts in a rendering."""
    return sum(len(turn(m)) for m in messages)


def chat_of(*contents: str) -> Chat:
    """Alternating user and assistant messages."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


HEAD = system_head("Be brief.")
# Each message starts with its own letter, so token prefixes part exactly at the role tags.
CHAT = chat_of(
    "alpha " * 5, "bravo " * 5, "charlie " * 5, "delta " * 5, "echo " * 5, "fox " * 5, "golf?"
)


def test_system_head() -> None:
    assert system_head("Be brief.") == [{"role": "system", "content": "Be brief."}]
    assert system_head(None) == [] and system_head("") == []


def test_everything_fits() -> None:
    tokens, dropped = fit_window(render, HEAD, CHAT, n_ctx=10_000, reserve=100)
    assert dropped == 0 and tokens == render(HEAD + CHAT)


def test_the_newest_messages_that_fit() -> None:
    # Room for the window that starts at message 4 (a user message), not the one at 2.
    n_ctx = len(render(HEAD + CHAT[4:])) + 50
    tokens, dropped = fit_window(render, HEAD, CHAT, n_ctx=n_ctx, reserve=50)
    assert dropped == 4
    assert tokens == render(HEAD + CHAT[4:])
    assert len(render(HEAD + CHAT[2:])) > n_ctx - 50


def test_a_window_never_starts_with_a_reply() -> None:
    # The budget fits messages 3: (which starts with the assistant's "delta") exactly.
    budget = len(render(HEAD + CHAT[3:]))
    tokens, dropped = fit_window(render, HEAD, CHAT, n_ctx=budget + 10, reserve=10)
    assert dropped == 4 and CHAT[dropped]["role"] == "user"
    assert tokens == render(HEAD + CHAT[4:])


def test_the_system_prompt_is_always_kept() -> None:
    n_ctx = len(render(HEAD + CHAT[-1:]))
    tokens, dropped = fit_window(render, HEAD, CHAT, n_ctx=n_ctx, reserve=0)
    assert dropped == len(CHAT) - 1
    assert "".join(map(chr, tokens)).startswith("<system>Be brief.</><user>golf?")


def test_a_last_message_too_long_for_the_context_is_an_error() -> None:
    chat = CHAT[:-1] + chat_of("x" * 500)[:1]
    with pytest.raises(KvchatError, match="does not fit the context"):
        fit_window(render, HEAD, chat, n_ctx=300, reserve=20)


def newest_that_fit(chat: Chat, n_ctx: int, reserve: int) -> int:
    """What fit_window must answer, one window at a time: the fewest messages left out
    such that the rest fits and does not start with a reply (-1: none fits)."""
    for dropped in range(len(chat)):
        window = chat[dropped:]
        if window[0]["role"] != "assistant" and len(render(HEAD + window)) <= n_ctx - reserve:
            return dropped
    return -1


def test_the_window_is_the_newest_that_fit_for_any_history_and_budget() -> None:
    import random

    rng = random.Random(26)
    for _ in range(300):
        roles = ["user" if i == 0 or rng.random() < 0.6 else "assistant" for i in range(40)]
        chat = [
            {"role": role, "content": "w" * rng.randint(0, 60)}
            for role in roles[: rng.randint(1, 40)]
        ]
        n_ctx, reserve = rng.randint(30, 1500), rng.randint(0, 20)
        expected = newest_that_fit(chat, n_ctx, reserve)
        if expected < 0:
            with pytest.raises(KvchatError, match="does not fit the context"):
                fit_window(render, HEAD, chat, n_ctx, reserve)
            continue
        tokens, dropped = fit_window(render, HEAD, chat, n_ctx, reserve)
        assert (dropped, tokens) == (expected, render(HEAD + chat[expected:])), (chat, n_ctx)


def test_a_history_of_thousands_costs_a_few_window_sized_renders() -> None:
    """An imported 5,000-message session: the first reply used to render the whole history
    once per message left out (hours with a real template); now a few renders, none much
    bigger than the window."""
    chat = chat_of(*(f"message {i} " * 3 for i in range(5000)))
    sizes: list[int] = []

    def counted(messages: Sequence[dict[str, str]]) -> list[int]:
        sizes.append(len(messages))
        return render(messages)

    n_ctx = len(render(HEAD + chat[-40:])) + 100
    tokens, dropped = fit_window(counted, HEAD, chat, n_ctx=n_ctx, reserve=100)
    assert dropped == 4960 and tokens == render(HEAD + chat[-40:])
    assert len(sizes) <= 2 * 13  # doubling to 64 messages, then halving back to 40
    assert max(sizes) <= 1 + 2 * 40 and sum(sizes) <= 10 * 40  # one render each: 12.5 million


def held_after_turn(chat: Chat) -> list[int]:
    """What the context holds after replying to ``chat``: history, reply, next user's opening."""
    previous = render(HEAD + chat[:-1])
    return settle_target(render, HEAD + chat, previous, held=[], n_ctx=10_000)


def test_settle_target_ends_at_the_next_users_words() -> None:
    held = held_after_turn(CHAT[:-1])
    assert "".join(map(chr, held)).endswith("<assistant>fox fox fox fox fox </><user>")
    assert held == render(HEAD + CHAT)[: len(held)]


def test_settle_target_keeps_the_context_when_the_template_drifts() -> None:
    drifted = [ord("?")] + render(HEAD + CHAT[:-2])
    assert settle_target(render, HEAD + CHAT[:-1], drifted, held=[1, 2, 3], n_ctx=10_000) == [
        1,
        2,
        3,
    ]


def test_the_shift_block_lies_on_message_boundaries() -> None:
    held = held_after_turn(CHAT[:-1])  # the context holds messages 0..5 and "<user>"
    prompt = render(HEAD + CHAT[2:])  # messages 0 and 1 left the window
    plan = plan_shift(render, HEAD, CHAT, held, prompt, dropped=2)
    assert plan is not None and plan.found and plan.messages == 2
    tag = len("<user>")  # both windows' first message opens with it: shared, kept
    assert plan.start == boundary(HEAD) + tag
    assert plan.end == boundary(HEAD + CHAT[:2]) + tag
    shifted = held[: plan.start] + held[plan.end :]
    assert shifted == prompt[: len(shifted)]  # only the new turn is left to decode


def test_the_most_recent_held_window_is_found() -> None:
    # The context already left message 0 and 1 out; now 0..3 are out: the block is 2 and 3.
    window = CHAT[2:]
    held = settle_target(render, HEAD + window[:-1], render(HEAD + window[:-2]), [], 10_000)
    prompt = render(HEAD + CHAT[4:])
    plan = plan_shift(render, HEAD, CHAT, held, prompt, dropped=4)
    assert plan is not None and plan.messages == 2
    assert (plan.start, plan.end) == (
        boundary(HEAD) + len("<user>"),
        boundary(HEAD + CHAT[2:4]) + len("<user>"),
    )


def test_no_shift_when_the_held_tokens_do_not_match() -> None:
    other = chat_of("alpha " * 5, "zulu " * 9, "yankee " * 5, "xray", "whiskey", "victor", "golf?")
    held = held_after_turn(other[:-1])
    prompt = render(HEAD + CHAT[2:])
    plan = plan_shift(render, HEAD, CHAT, held, prompt, dropped=2)
    assert plan == ShiftPlan(plan.start, plan.start) and not plan.found
    assert plan.start == boundary(HEAD) + len("<user>")  # only the shared opening


def test_no_shift_without_dropped_messages_or_held_tokens() -> None:
    held = held_after_turn(CHAT[:-1])
    prompt = render(HEAD + CHAT)
    assert plan_shift(render, HEAD, CHAT, held, prompt, dropped=0) is None
    assert plan_shift(render, HEAD, CHAT, [], render(HEAD + CHAT[2:]), dropped=2) is None


def test_no_shift_when_the_context_already_holds_the_window() -> None:
    prompt = render(HEAD + CHAT[2:])
    assert plan_shift(render, HEAD, CHAT, prompt, prompt, dropped=2) is None
    assert plan_shift(render, HEAD, CHAT, prompt[:-5], prompt, dropped=2) is None
