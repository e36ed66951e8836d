"""A thinking model's reply in two parts: its reasoning and its answer.

Models mark their reasoning in one of two ways, and kvchat follows the model's own markers:

* **think tags** (Qwen3, DeepSeek-R1 distills, SmolLM3, Phi-4-reasoning): ``<think>…</think>``
  before the answer. Some templates open the block in the generation prompt itself (the
  R1 distills), so the reply starts inside it and only ``</think>`` is generated.
* **harmony channels** (gpt-oss): ``<|channel|>analysis<|message|>…<|end|>`` then
  ``<|start|>assistant<|channel|>final<|message|>…``.

What the template does with earlier reasoning (drop it, keep it after the last question)
is the template's business: the service hands it the reasoning apart
(``reasoning_content``) and renders whatever it makes of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_END = re.compile(r"<\|(?:end|return|call)\|>")
_HARMONY_HEAD = re.compile(r"^(?:<\|start\|>assistant)?")

Kind = Literal["none", "think", "harmony"]


@dataclass(frozen=True)
class ReasoningStyle:
    """How a model's replies carry reasoning."""

    kind: Kind = "none"
    # The generation prompt opens the think block: the reply starts inside it.
    opens_inside: bool = False

    @property
    def thinks(self) -> bool:
        return self.kind != "none"


NO_REASONING = ReasoningStyle()


def split_reasoning(text: str, style: ReasoningStyle) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply. A reply cut while still reasoning is all
    reasoning and no answer; a reply with no markers is all answer."""
    if style.kind == "harmony":
        return _split_harmony(text)
    if style.kind == "think":
        return _split_think(text, style.opens_inside)
    return "", text


def _split_think(text: str, opens_inside: bool) -> tuple[str, str]:
    body = text
    if not opens_inside:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            if THINK_CLOSE not in text:
                return "", text
            stripped = THINK_OPEN + stripped  # a template that opened it without saying so
        body = stripped[len(THINK_OPEN) :]
    reasoning, closed, answer = body.partition(THINK_CLOSE)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), answer.lstrip()


def _split_harmony(text: str) -> tuple[str, str]:
    reasoning = ""
    rest = text
    at = rest.find(HARMONY_ANALYSIS)
    if at >= 0:
        rest = rest[at + len(HARMONY_ANALYSIS) :]
        end = _HARMONY_END.search(rest)
        if end is None:
            return rest.strip(), ""
        reasoning, rest = rest[: end.start()], rest[end.end() :]
    at = rest.find(HARMONY_FINAL)
    if at >= 0:
        rest = rest[at + len(HARMONY_FINAL) :]
    elif reasoning:
        rest = _HARMONY_HEAD.sub("", rest)
    end = _HARMONY_END.search(rest)
    answer = rest[: end.start()] if end is not None else rest
    return reasoning.strip(), answer.strip()


def join_reasoning(reasoning: str, answer: str, style: ReasoningStyle) -> str:
    """The reply as the model wrote it (for a continue that resumes inside its text)."""
    if not reasoning or style.kind == "none":
        return answer
    if style.kind == "harmony":
        return f"{HARMONY_ANALYSIS}{reasoning}<|end|><|start|>assistant{HARMONY_FINAL}{answer}"
    opening = "" if style.opens_inside else THINK_OPEN
    return f"{opening}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}"


def as_written(reasoning: str, answer: str, style: ReasoningStyle) -> str:
    """A stored reply as the model wrote it, to continue it: a reply cut while reasoning
    is continued inside its reasoning (its think block left open)."""
    if reasoning and not answer and style.kind == "think":
        return ("" if style.opens_inside else THINK_OPEN) + "\n" + reasoning
    return join_reasoning(reasoning, answer, style)


class ReasoningStream:
    """Splits a reply as it streams: each piece goes to the reasoning or to the answer (a
    marker split over two pieces is held back until it is whole)."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self.text = ""
        self._shown_reasoning = 0
        self._shown_answer = 0

    def feed(self, piece: str) -> tuple[str, str]:
        """The new reasoning and the new answer text that ``piece`` completes."""
        self.text += piece
        if not self.style.thinks:
            return "", piece
        reasoning, answer = split_reasoning(self._settled(), self.style)
        new_reasoning = reasoning[self._shown_reasoning :]
        new_answer = answer[self._shown_answer :]
        self._shown_reasoning = max(self._shown_reasoning, len(reasoning))
        self._shown_answer = max(self._shown_answer, len(answer))
        return new_reasoning, new_answer

    @property
    def reasoning(self) -> str:
        return split_reasoning(self.text, self.style)[0]

    @property
    def answer(self) -> str:
        return split_reasoning(self.text, self.style)[1]

    @property
    def in_reasoning(self) -> bool:
        """Whether the model is still reasoning (no answer has begun)."""
        if not self.style.thinks:
            return False
        reasoning, answer = split_reasoning(self.text, self.style)
        return not answer and (bool(reasoning) or self.style.opens_inside or not self.text)

    def _settled(self) -> str:
        """The text without a trailing partial marker ("</thi" …)."""
        text = self.text
        for marker in (THINK_OPEN, THINK_CLOSE, HARMONY_ANALYSIS, HARMONY_FINAL, "<|end|>"):
            for cut in range(len(marker) - 1, 0, -1):
                if text.endswith(marker[:cut]):
                    return text[: len(text) - cut]
        return text


def detect_style(render: Callable[[list[dict[str, str]]], str]) -> ReasoningStyle:
    """The style of the model's chat template, found by rendering it (``render``: the
    engine's, over messages, ending with the assistant's opening): a template that writes
    ``<|channel|>`` speaks harmony; one whose generation prompt opens ``<think>`` starts
    replies inside it; one that writes a reply's ``reasoning_content`` in think tags, or
    opens with one, thinks in tags. Anything else (or a template that fails) has none."""
    question = {"role": "user", "content": "Q"}
    answered = [question, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    try:
        opening = render([question])
        history = render(answered)
    except Exception:  # a template's own error: treat it as one that does not think
        return NO_REASONING
    if "<|channel|>" in opening or "<|channel|>" in history:
        return ReasoningStyle("harmony")
    if opening.rstrip().endswith(THINK_OPEN):
        return ReasoningStyle("think", opens_inside=True)
    if THINK_CLOSE in history or THINK_OPEN in opening:
        return ReasoningStyle("think")
    return NO_REASONING


# The chat-template keywords that turn a model's thinking on or off, as (keyword, value
# for on, value for off): Qwen3 and SmolLM3 take enable_thinking; gpt-oss reasons always,
# at an effort.
SWITCHES: tuple[tuple[str, object, object], ...] = (
    ("enable_thinking", True, False),
    ("reasoning_effort", "high", "low"),
)


@dataclass(frozen=True)
class ThinkingSwitch:
    """How a template turns thinking on or off (``keyword`` None: it cannot)."""

    keyword: str | None = None
    on: object = None
    off: object = None

    def options(self, think: bool | None) -> dict[str, object]:
        """The template's keyword arguments for ``think`` (None: the template's default)."""
        if self.keyword is None or think is None:
            return {}
        return {self.keyword: self.on if think else self.off}


NO_SWITCH = ThinkingSwitch()


def find_switch(render: Callable[[dict[str, object]], str]) -> ThinkingSwitch:
    """The keyword the template answers to: ``render(options)`` renders a question with
    those keyword arguments; a keyword whose two values render differently is the one."""
    try:
        for keyword, on, off in SWITCHES:
            if render({keyword: on}) != render({keyword: off}):
                return ThinkingSwitch(keyword, on, off)
    except Exception:  # a template's own error: no switch
        return NO_SWITCH
    return NO_SWITCH
