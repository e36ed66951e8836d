"""A model's reply is text from outside: the tool-call reader's hostile-input campaign.

Generated replies for every family (cut anywhere, characters flipped, markers repeated or
nested, arguments deep, huge, not finite, not JSON, Python that is not a literal, names
that are paths or markup): each is read into calls with plain bounded names and JSON-object
arguments, or refused with one line (:class:`ToolCallError`), in bounded time, never another
exception. A sample of 24 cases runs by default; ``pytest -m stress`` runs 480.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from kvchat.tools.calls import MAX_CALLS, NAME, CallFormat, ToolCallError, parse_reply

GOOD = {
    CallFormat.HERMES: '<tool_call>\n{"name": "demo.add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    CallFormat.LLAMA3: '<|python_tag|>{"name": "demo.add", "parameters": {"a": 2, "b": 3}}<|eom_id|>',
    CallFormat.MISTRAL: '[TOOL_CALLS][{"name": "demo.add", "arguments": {"a": 2, "b": 3}, "id": "a1b2c3d4e"}]',
    CallFormat.HARMONY: "<|start|>assistant<|channel|>commentary to=functions.demo.add <|constrain|>json"
    '<|message|>{"a": 2, "b": 3}<|call|>',
    CallFormat.GRANITE: '<|tool_call|>[{"name": "demo.add", "arguments": {"a": 2, "b": 3}}]',
    CallFormat.LFM2: '<|tool_call_start|>[demo.add(a=2, b="3")]<|tool_call_end|>',
}
MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|message|>",
    "<|call|>",
    "<|channel|>",
    " to=functions.",
    " to=browser.",
    "<|end|>",
    "<|tool_call|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|im_end|>",
    "<|eot_id|>",
]
HOSTILE_VALUES = [
    "NaN",
    "Infinity",
    "-1e999",
    "1e999",
    '"\\ud800"',
    "null",
    "[]",
    '"' + "x" * 70_000 + '"',
    "[" * 40 + "]" * 40,
    "{" * 40,
    "9" * 5000,
    "__import__('os').system('x')",
    "{1, 2}",
    "b'bytes'",
    "lambda: 1",
    "(1).__class__",
    '"\\u0000"',
    "1j",
    "...",
]
HOSTILE_NAMES = [
    "../../etc/passwd",
    "a b",
    "",
    "x" * 300,
    "<|im_end|>",
    "demo.add\n",
    "ж",
    "-rf",
    ".",
    "name\x1b[31m",
    "$(id)",
]


def hostile_reply(rng: random.Random) -> tuple[CallFormat, str]:
    fmt = rng.choice(list(CallFormat))
    reply = GOOD[fmt]
    for _ in range(rng.randint(1, 4)):
        move = rng.randrange(8)
        if move == 0:  # cut anywhere
            reply = reply[: rng.randrange(len(reply) + 1)]
        elif move == 1:  # a character changed
            at = rng.randrange(max(1, len(reply)))
            reply = (
                reply[:at]
                + chr(
                    rng.choice([0, 10, 34, 39, 40, 41, 44, 91, 93, 123, 125, 0x1B, 0xD800, 0x2060])
                )
                + reply[at + 1 :]
            )
        elif move == 2:  # a marker put somewhere
            at = rng.randrange(len(reply) + 1)
            reply = reply[:at] + rng.choice(MARKERS) + reply[at:]
        elif move == 3:  # a hostile value in place of an argument
            reply = reply.replace("2", rng.choice(HOSTILE_VALUES), 1)
        elif move == 4:  # a hostile name
            reply = reply.replace("demo.add", rng.choice(HOSTILE_NAMES), 1)
        elif move == 5:  # many calls
            reply = reply * rng.choice([2, MAX_CALLS, MAX_CALLS + 1, 40])
        elif move == 6:  # text around it
            reply = (
                rng.choice(["Sure. ", "", "\n\n", "<think>x</think>"])
                + reply
                + rng.choice(["", " done", "<|im_end|>"])
            )
        else:  # arguments as a JSON string, or of another type
            reply = reply.replace(
                '{"a": 2, "b": 3}', rng.choice(['"{\\"a\\": 2}"', "[1, 2]", '"x"', "7", "{}"]), 1
            )
    return fmt, reply


def check(fmt: CallFormat, reply: str) -> str:
    """Read ``reply``; what came of it (asserting it is a bounded outcome)."""
    started = time.perf_counter()
    try:
        parsed = parse_reply(reply, fmt)
    except ToolCallError as exc:
        line = str(exc)
        assert line and "\n" not in line and len(line) <= 400, line
        outcome = "refused"
    else:
        assert len(parsed.calls) <= MAX_CALLS
        for call in parsed.calls:
            assert NAME.fullmatch(call.name), call.name
            assert isinstance(call.arguments, dict)
            json.dumps(call.arguments, allow_nan=False)  # a JSON object, finite numbers
        outcome = "calls" if parsed.calls else "text"
    assert time.perf_counter() - started < 2.0
    return outcome


def campaign(cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    seen = {"refused": 0, "calls": 0, "text": 0}
    for _ in range(cases):
        fmt, reply = hostile_reply(rng)
        seen[check(fmt, reply)] += 1
    return seen


def test_campaign_sample() -> None:
    seen = campaign(24, seed=1)
    assert sum(seen.values()) == 24 and seen["refused"] > 0


def test_each_good_call_is_read() -> None:
    for fmt, reply in GOOD.items():
        assert check(fmt, reply) == "calls"


@pytest.mark.stress
def test_stress_campaign() -> None:
    seen = campaign(480, seed=2)
    assert sum(seen.values()) == 480
    print(f"\nSTRESS tool-call replies: 480 read: {seen}")
