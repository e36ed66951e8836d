"""A thinking model's reasoning, folded to one line above the reply's answer.

The line says how long and how much the model thought ("Thought for 12 s · 431 tokens");
``t`` on the message, or a click on the line, unfolds the reasoning (and folds it again).
The reasoning's text is built only when unfolded: a session of long reasoning replies
opens as fast as one without.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Static

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


class Thought(Vertical):
    """The folded reasoning of one reply (see the module docstring); folded by default."""

    DEFAULT_CSS = """
    Thought {
        height: auto;
        margin: 0;
    }
    Thought > .thought-line {
        color: $text-muted;
        text-style: italic;
    }
    Thought > .thought-line:hover {
        text-style: italic underline;
    }
    Thought > .thought-body {
        color: $text-muted;
        padding: 0 0 0 1;
        border-left: outer $foreground 20%;
        margin: 0 0 1 0;
    }
    """

    def __init__(self, reasoning: str = "", figures: ThoughtFigures | None = None) -> None:
        super().__init__(classes="thought")
        self.reasoning = reasoning
        self.figures = figures or ThoughtFigures()
        self.thinking = False  # the model is reasoning now (the line says Thinking…)
        self.shown = False

    def compose(self) -> ComposeResult:
        yield Label(self.line, classes="thought-line", markup=False)

    @property
    def line(self) -> str:
        return thought_line(self.reasoning, self.figures, thinking=self.thinking, shown=self.shown)

    @property
    def body_text(self) -> str:
        """What the unfolded block shows ("" while folded: nothing is built)."""
        bodies = list(self.query(".thought-body").results(Static))
        return str(bodies[0].content) if bodies else ""

    def _refresh_line(self) -> None:
        for label in self.query(".thought-line").results(Label):
            label.update(self.line)

    async def toggle(self) -> None:
        """Unfold the reasoning, or fold it again."""
        self.shown = not self.shown
        bodies = list(self.query(".thought-body").results(Static))
        if self.shown and not bodies:
            await self.mount(Static(visible(self.reasoning), classes="thought-body", markup=False))
        elif bodies:
            bodies[0].display = self.shown
            if self.shown:
                bodies[0].update(visible(self.reasoning))
        self._refresh_line()

    def set(
        self, reasoning: str, figures: ThoughtFigures | None = None, *, thinking: bool = False
    ) -> None:
        """Show new reasoning (streamed further, or another version of the reply)."""
        self.reasoning = reasoning
        if figures is not None:
            self.figures = figures
        self.thinking = thinking
        if self.shown:
            for body in self.query(".thought-body").results(Static):
                body.update(visible(reasoning))
        self._refresh_line()

    async def on_click(self, event: events.Click) -> None:
        widget = event.widget
        if widget is not None and widget.has_class("thought-line"):
            event.stop()
            await self.toggle()
