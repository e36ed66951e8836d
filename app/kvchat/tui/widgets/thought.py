"""A thinking model's reasoning, folded to one line above the reply's answer.

The line says how long and how much the model thought ("Thought for 12 s · 431 tokens");
Enter on the message, or a click on the line, unfolds the reasoning (and folds it again).
The message draws the line and, only while unfolded, the reasoning's text: a session of
long reasoning replies opens as fast as one without.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.text import visible


@dataclass
class ThoughtFigures:
    """How much the model thought: tokens counted as they streamed, and for how long
    (None when not known: a reply stored earlier, or by another process)."""

    tokens: int | None = None
    seconds: float | None = None


def thought_line(
    reasoning: str, figures: ThoughtFigures | None, *, thinking: bool, shown: bool
) -> str:
    """The folded block's one line: ``▸ Thought for 12 s · 431 tokens`` (characters when
    the token count is not known); ``Thinking…`` while the model still reasons."""
    figures = figures or ThoughtFigures()
    mark = "▾" if shown else "▸"
    if thinking:
        head = "Thinking…"
    elif figures.seconds is not None:
        head = f"Thought for {_seconds(figures.seconds)}"
    else:
        head = "Thought"
    if figures.tokens is not None:
        size = f"{figures.tokens:,} token{'s' if figures.tokens != 1 else ''}"
    else:
        size = f"{len(reasoning):,} character{'s' if len(reasoning) != 1 else ''}"
    return f"{mark} {head} · {size}"


def _seconds(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


class Thought:
    """The reasoning of one reply, folded by default; the message draws it (see
    ``message_view.py``): its line, and the reasoning's text below it while unfolded."""

    def __init__(self, reasoning: str = "", figures: ThoughtFigures | None = None) -> None:
        self.reasoning = reasoning
        self.figures = figures or ThoughtFigures()
        self.thinking = False  # the model is reasoning now (the line says Thinking…)
        self.shown = False

    @property
    def line(self) -> str:
        return thought_line(self.reasoning, self.figures, thinking=self.thinking, shown=self.shown)

    @property
    def body_text(self) -> str:
        """What the unfolded block shows: the reasoning as plain text ("" while folded)."""
        return visible(self.reasoning) if self.shown else ""

    def toggle(self) -> None:
        """Unfold the reasoning, or fold it again."""
        self.shown = not self.shown

    def set(
        self, reasoning: str, figures: ThoughtFigures | None = None, *, thinking: bool = False
    ) -> None:
        """Show new reasoning (streamed further, or another version of the reply)."""
        self.reasoning = reasoning
        if figures is not None:
            self.figures = figures
        self.thinking = thinking
