"""One message of the conversation: its role line, its folded reasoning, its Markdown and a
fold note, drawn as lines by one widget, and what a key on it asks for (copy, details,
branch, edit, versions), as typed Messages to the screen.

A message is one widget (a :class:`~kvchat.tui.widgets.body.MessageBody` that draws its
role line and notes around the Markdown): a container with a label and a body was three
widgets to style, lay out and composite per message at each switch (mounting and drawing
24 replies took ~1.5 times the CPU time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.segment import Segment
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.message import Message as TextualMessage
from textual.strip import Strip

from kvchat.text import visible
from kvchat.tui.widgets.body import NO_LINES, BodyStream, MessageBody
from kvchat.tui.widgets.thought import Thought, ThoughtFigures

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.rules_core import StateCore

    from kvchat.service.chat import Message

# Markdown that shows text as written: no raw HTML (``<script>``, ``Vec<String>`` are text)
# and no character references (``&amp;`` stays as typed); formatting still renders.
PLAIN_TEXT_RULES = ("html_inline", "html_block", "entity")


@cache
def message_parser() -> MarkdownIt:
    """The Markdown parser of every message (Textual's default, less the rules above).

    One parser for all: building one costs more than parsing a short message, and a
    session switch builds a page of them. Parsing keeps its state apart from the parser
    (only the rule chains are compiled on first use, done here), so threads can share it.
    """
    return _warmed(_new_parser())


@cache
def user_parser() -> MarkdownIt:
    """The parser of your own messages: :func:`message_parser`'s rules, and every line
    break you typed is kept (each soft break becomes a hard one, so lists, headings and
    tables that follow a line still render, and no backslash is added to the text)."""
    parser = _new_parser()
    parser.core.ruler.push("typed_line_breaks", _typed_line_breaks)
    return _warmed(parser)


def _new_parser() -> MarkdownIt:
    from markdown_it import MarkdownIt

    return MarkdownIt("gfm-like").disable(PLAIN_TEXT_RULES)


def _warmed(parser: MarkdownIt) -> MarkdownIt:
    parser.parse("*a*\n\n- b\n\n| c |\n| - |\n")  # compiles the rule chains now
    return parser


def _typed_line_breaks(state: StateCore) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type, child.tag = "hardbreak", "br"


ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool result"}
# A message of yours longer than this many lines (a long paste) shows folded to its first
# FOLD_LINES; Enter on it (or a click on the note) shows it all.
FOLD_LINES = 20
FOLD_AFTER = 24
# A tool's result longer than this many lines shows folded to its first TOOL_FOLD_LINES.
TOOL_FOLD_LINES = 4
TOOL_FOLD_AFTER = 6
# A message longer than BIG_CHARS (yours or a reply: a pasted log, an imported answer)
# shows its first FOLD_CHARS characters until unfolded, so opening its session never waits
# for its Markdown to be built.
BIG_CHARS = 50_000
FOLD_CHARS = 4_000
# kvchat.service.streaming.STREAMING (not imported: it brings the engine's modules in before
# the first paint): a reply stored as it streamed and never committed, cut off by a kill.
STREAMING = "streaming"


class MessageView(MessageBody, can_focus=True):
    """One message, headed by its role and its number in the session (``#3``: what
    ``kvchat fork --at`` takes). Focus it (click, or Tab then ↑/↓) and the screen's keys act
    on it: Ctrl+O copies it, F5 a code block of it, F3 its details, Ctrl+T branches a new
    session from it, F4 edits it (your messages). No key that can be typed acts on a
    message: a printable key goes to the input (:class:`TypedAhead`), so a sentence typed
    after a search jump or a click lands there as typed. A thinking model's reply shows its
    reasoning folded above the answer (:class:`Thought`): Enter or a click unfolds it.

    It draws, as lines: the role line, the reasoning's line (and its text, unfolded), the
    Markdown, and a long message's fold note (see the module docstring)."""

    COMPONENT_CLASSES = {"message-view--role", "message-view--note", "message-view--reasoning"}
    BINDINGS = [
        Binding("up", "move(-1)", "Previous message", show=False),
        Binding("down", "move(1)", "Next message", show=False),
        Binding("left", "version(-1)", "Previous version of the reply", show=False),
        Binding("right", "version(1)", "Next version of the reply", show=False),
        Binding("enter", "enter", "Show all / fold a long message, or the reasoning", show=False),
    ]

    @dataclass
    class VersionRequested(TextualMessage):
        """←/→ on a reply: show its previous (-1) or next (+1) version."""

        view: MessageView
        step: int

    @dataclass
    class MoveRequested(TextualMessage):
        """↑/↓ on a message: focus the one ``step`` places away (the conversation moves)."""

        view: MessageView
        step: int

    @dataclass
    class TypedAhead(TextualMessage):
        """A printable key typed on a message: it belongs in the input."""

        character: str

    def __init__(
        self,
        role: str,
        text: str = "",
        *,
        message_id: int | None = None,
        partial: bool = False,
        streaming: bool = False,
        number: int | None = None,
        pending: bool = False,
        finish_reason: str | None = None,
        reasoning: str = "",
        figures: ThoughtFigures | None = None,
    ) -> None:
        classes = f"message -{role}" + (" -partial" if partial else "")
        super().__init__(
            classes=classes + (" -pending" if pending else ""),
            parser_factory=user_parser if role in ("user", "tool") else message_parser,
        )
        self.role = role
        self.text = text
        self.message_id = message_id
        self.partial = partial
        self.streaming = streaming
        self.number = number  # 1-based position in the session's messages
        self.stream: BodyStream | None = None
        # Why the reply ended, as stored ("length": stopped at the token limit).
        self.finish_reason = finish_reason
        self.cut = False  # the session's last reply, stopped at the token limit: F12 goes on
        self.version = (1, 1)  # a reply's version shown, of how many (←/→ switch)
        # Your message as Enter sent it, before it is stored (it left the input at once).
        self.pending = pending
        # A long message of yours shows its first FOLD_LINES lines until unfolded; a very
        # long one of any role its first FOLD_CHARS characters.
        self.folded = self.foldable
        # A thinking model's reasoning before the answer ("" when none), shown folded.
        self.reasoning = reasoning
        self.figures = figures
        self.thought: Thought | None = Thought(reasoning, figures) if reasoning else None
        self._source = self._shown(text)
        # The lines drawn above and below the Markdown, and what they were drawn from.
        self._head_lines: tuple[tuple[object, ...], list[Strip]] | None = None
        self._foot_lines: tuple[tuple[object, ...], list[Strip]] | None = None

    @classmethod
    def from_message(
        cls, message: Message, number: int | None = None, figures: ThoughtFigures | None = None
    ) -> MessageView:
        return cls(
            message.role,
            message.content,
            message_id=message.id,
            partial=message.partial,
            number=number,
            finish_reason=message.finish_reason,
            reasoning=message.reasoning,
            figures=figures,
        )

    @property
    def body(self) -> MessageView:
        """The widget that draws the Markdown: the message itself (its source, its lines)."""
        return self

    @property
    def big(self) -> bool:
        """A message too long to build at once (see BIG_CHARS)."""
        return len(self.text) > BIG_CHARS

    @property
    def foldable(self) -> bool:
        """A message of yours long enough to fold (a long paste), or any very long one."""
        lines = self.text.count("\n")
        if self.role == "tool":
            return self.big or lines >= TOOL_FOLD_AFTER
        return self.big or (self.role == "user" and lines >= FOLD_AFTER)

    @property
    def fold_lines(self) -> int:
        """The lines a folded message shows."""
        return TOOL_FOLD_LINES if self.role == "tool" else FOLD_LINES

    def _shown(self, text: str) -> str:
        """The Markdown source shown for ``text``: as written, without control codes (while
        folded: the first FOLD_LINES lines, or FOLD_CHARS characters of a very long one)."""
        if self.folded and self.big:
            return visible(text[:FOLD_CHARS])
        text = visible(text)
        if self.folded:
            text = "\n".join(text.split("\n")[: self.fold_lines])
        return text

    @property
    def fold_note(self) -> str:
        """The line below a long message ("" for one too short to fold)."""
        if not self.foldable:
            return ""
        if self.folded and self.big:
            more = len(self.text) - FOLD_CHARS
            return f"⋯ {more:,} more characters · Enter shows them all"
        if self.folded:
            more = self.text.count("\n") + 1 - self.fold_lines
            return f"⋯ {more:,} more lines · Enter shows them all"
        return "Enter folds this message again"

    async def action_enter(self) -> None:
        """Enter: a long message shows all of it (or folds again); else a reply's
        reasoning unfolds (or folds again)."""
        if self.foldable:
            await self.action_toggle_fold()
        elif self.thought is not None:
            await self.action_toggle_thought()

    async def action_toggle_fold(self) -> None:
        """Show all of a long message, or fold it again."""
        if not self.foldable:
            return
        self.folded = not self.folded
        self.update(self._shown(self.text))
        self._redraw()

    async def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        width = self.content_region.width
        if self.thought is not None and offset.y == len(self._header_lines(width)):
            event.stop()
            await self.action_toggle_thought()
        elif self.fold_note and offset.y >= len(self._drawn(width)) - len(self._foot(width)):
            await self.action_toggle_fold()

    async def action_toggle_thought(self) -> None:
        """Enter or a click: unfold the reasoning of a thinking model's reply, or fold it again."""
        if self.thought is not None:
            self.thought.toggle()
            self._redraw()
        elif self.role == "assistant":
            self.app.notify("This reply has no reasoning to show")

    async def set_reasoning(
        self, reasoning: str, figures: ThoughtFigures | None = None, *, thinking: bool = False
    ) -> None:
        """Show ``reasoning`` in the folded block (above the answer from the first reasoning
        on; gone when there is none)."""
        self.reasoning = reasoning
        if figures is not None:
            self.figures = figures
        if not reasoning and not thinking:
            self.thought = None
        elif self.thought is None:
            self.thought = Thought(reasoning, self.figures)
            self.thought.thinking = thinking
        else:
            self.thought.set(reasoning, self.figures, thinking=thinking)
        self._redraw()

    @property
    def header(self) -> str:
        """The role line: who, the message's number, its version, and how it ended."""
        name = ROLE_NAMES.get(self.role, self.role)
        if self.number is not None:
            name = f"{name} · #{self.number}"
        if self.version[1] > 1:
            name = f"{name} · reply {self.version[0]}/{self.version[1]} (←/→)"
        if self.pending:
            return f"{name} · sending…"
        if self.streaming:
            return f"{name} ▍"
        if self.partial and self.finish_reason == STREAMING:
            # Stored as it streamed, never committed: the kvchat writing it ended (a kill).
            return f"{name} · cut off: kvchat ended"
        if self.partial:
            return f"{name} · partial (stopped)"
        if self.cut:
            return f"{name} · stopped at the token limit (F12 continues)"
        if self.finish_reason == "length":
            return f"{name} · stopped at the token limit"
        return name

    # --- the lines drawn around the Markdown -------------------------------------------------

    def _text_lines(self, text: str, component: str, width: int) -> list[Strip]:
        """``text`` (plain, never markup) wrapped to ``width`` in a component's style."""
        base = self.visual_style.rich_style
        style = base + self.get_component_rich_style(component)
        if "\n" not in text and cell_len(text) <= width:  # one line: no wrapping to do
            return [Strip([Segment(text, style)]).extend_cell_length(width, base)]
        options = self.app.console_options.update(width=width, height=None, highlight=False)
        shown = Text(text, style=style, end="")
        rows = self.app.console.render_lines(shown, options, style=base, pad=True)
        return [Strip(row, width) for row in rows]

    def _header_lines(self, width: int) -> list[Strip]:
        return self._text_lines(self.header, "message-view--role", width)

    def _head(self, width: int) -> list[Strip]:
        """The role line, and the reasoning's line (and text, while unfolded)."""
        thought = self.thought
        folded = thought is None or not thought.shown
        # The header's text tells its style apart (pending, partial); the base style the
        # focus and the theme (looking the component styles up here cost ~3 ms a switch).
        key = (
            width,
            self.header,
            self.visual_style.rich_style,
            self.app.theme,
            None if thought is None else thought.line,
            None if folded else thought.reasoning,
        )
        if self._head_lines is not None and self._head_lines[0] == key:
            return self._head_lines[1]
        lines = self._header_lines(width)
        if thought is not None:
            lines += self._text_lines(thought.line, "message-view--note", width)
            if thought.shown:
                lines += self._reasoning_lines(thought.body_text, width)
        self._head_lines = (key, lines)
        return lines

    def _reasoning_lines(self, reasoning: str, width: int) -> list[Strip]:
        """The unfolded reasoning: muted, behind a rule on its left, a blank line below."""
        base = self.visual_style.rich_style
        rule = Segment("▏ ", base + self.get_component_rich_style("message-view--reasoning"))
        lines = self._text_lines(reasoning, "message-view--reasoning", max(width - 2, 1))
        ruled = [Strip([rule, *line]).crop_extend(0, width, base) for line in lines]
        return [*ruled, Strip.blank(width, base)]

    def _foot(self, width: int) -> list[Strip]:
        """The fold note of a long message."""
        note = self.fold_note
        if not note:
            return NO_LINES
        key = (width, note, self.visual_style.rich_style, self.app.theme)
        if self._foot_lines is not None and self._foot_lines[0] == key:
            return self._foot_lines[1]
        lines = self._text_lines(note, "message-view--note", width)
        self._foot_lines = (key, lines)
        return lines

    @property
    def drawn_lines(self) -> list[str]:
        """The lines it draws, as plain text (what the tests read)."""
        return self.drawn_text.split("\n")

    # --- versions, storing, streaming ----------------------------------------------------------

    def set_version(self, position: int, count: int) -> None:
        """Show which version of the reply this is, of how many."""
        if (position, count) != self.version:
            self.version = (position, count)
            self._redraw()

    async def show_version(
        self,
        message: Message,
        position: int,
        count: int,
        figures: ThoughtFigures | None = None,
    ) -> None:
        """Show another version of this reply in place (``figures``: how it thought, when
        known)."""
        self.message_id = message.id
        self.partial = message.partial
        self.text = message.content
        self.finish_reason = message.finish_reason
        self.cut = message.finish_reason == "length"  # only the last reply has versions
        self.version = (position, count)
        await self.set_reasoning(message.reasoning, figures or ThoughtFigures())
        self.update(self._shown(self.text))
        self.set_class(self.partial, "-partial")
        self._redraw()

    def set_stored(self, message_id: int) -> None:
        """Your pending message is stored (committed): show it as any other message."""
        self.message_id = message_id
        self.pending = False
        self.remove_class("-pending")
        self._redraw()

    def set_cut(self, cut: bool) -> None:
        """Mark (or unmark) the reply as stopped at the token limit, in its header."""
        if cut != self.cut:
            self.cut = cut
            self._redraw()

    def start_stream(self) -> BodyStream:
        self.streaming = True
        self._redraw()  # a continued reply shows it is streaming again
        self.stream = super().start_stream()
        return self.stream

    async def write(self, text: str) -> None:
        """Append a buffered chunk of the reply being streamed."""
        self.text += text
        if self.stream is not None:
            await self.stream.write(visible(text))

    async def finish(
        self,
        *,
        text: str,
        message_id: int | None,
        partial: bool,
        finish_reason: str | None = None,
        reasoning: str | None = None,
    ) -> None:
        """End the stream; ``text`` is the reply as the service committed it (and
        ``finish_reason`` why it ended; None keeps what was known; ``reasoning`` its
        reasoning apart, None: as streamed)."""
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
        self.streaming = False
        self.message_id = message_id
        self.partial = partial
        if finish_reason is not None:
            self.finish_reason = finish_reason
        self.text = text
        if reasoning is not None or self.thought is not None:
            await self.set_reasoning(self.reasoning if reasoning is None else reasoning)
        self.update(self._shown(text))  # e.g. a chunk raced the end of the stream
        self.set_class(partial, "-partial")
        self._redraw()

    # --- keys ------------------------------------------------------------------------------------

    def on_key(self, event: events.Key) -> None:
        if event.is_printable and event.character:
            event.stop()
            event.prevent_default()
            self.post_message(self.TypedAhead(event.character))

    def action_move(self, step: int) -> None:
        self.post_message(self.MoveRequested(self, step))

    def action_version(self, step: int) -> None:
        if self.role == "assistant":
            self.post_message(self.VersionRequested(self, step))
