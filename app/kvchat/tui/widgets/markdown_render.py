"""Markdown rendered into lines with Rich, for :class:`~kvchat.tui.widgets.body.MessageBody`.

kvchat's own parsers read the Markdown (raw HTML and character references stay text);
Rich's Markdown elements draw it, some adjusted for a chat (headings on the left, numbered
items with their dots, code on the theme's background, addresses shown once), in colours
taken from the app's theme. Blocks can be rendered one at a time (a streaming reply) and a
long source in parts (see :func:`parts`). Imported on first use: it imports Pygments.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from rich._loop import loop_first
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markdown import CodeBlock, Heading, ListItem, Markdown, MarkdownElement
from rich.segment import Segment
from rich.style import Style
from rich.syntax import Syntax
from rich.theme import Theme
from textual.color import Color
from textual.strip import Strip

if TYPE_CHECKING:
    from markdown_it.token import Token

# A long source is rendered in parts of at least this many characters (see parts()).
PART_CHARS = 2_000

# Code blocks in these languages are highlighted without a pause the first time one is
# drawn: their lexers are loaded (and their patterns compiled) by warm_highlighting().
WARM_LANGUAGES = ("python", "bash", "javascript", "json", "text")


def code_theme(dark: bool) -> str:
    """The Pygments theme of code blocks, on a dark or a light app theme."""
    return "monokai" if dark else "default"


def warm_highlighting(dark: bool) -> None:
    """Load the lexers of WARM_LANGUAGES and the code theme now (the app does it in a thread
    once it is up): the first Python block drawn took 26 ms more than the next."""
    from pygments.lexers import get_lexer_by_name
    from pygments.styles import get_style_by_name

    get_style_by_name(code_theme(dark))
    for name in WARM_LANGUAGES:
        get_lexer_by_name(name)


class _LeftHeading(Heading):
    """Headings aligned left, as in a chat (Rich centres the first level)."""

    LEVEL_ALIGN: ClassVar[dict[str, str]] = {}  # type: ignore[misc]


class _CodeBlock(CodeBlock):
    """A fenced block on the theme's code background, highlighted, wrapped."""

    background = "#1e1e1e"

    @classmethod
    def create(cls, markdown: Markdown, token: Token) -> CodeBlock:
        block = super().create(markdown, token)
        block.background = getattr(markdown, "code_background", cls.background)  # type: ignore[attr-defined]
        return block

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        code = str(self.text).rstrip()
        yield Syntax(
            code,
            self.lexer_name,
            theme=self.theme,
            word_wrap=True,
            padding=(1, 2),
            background_color=self.background,  # type: ignore[attr-defined]
        )


class _ListItem(ListItem):
    """A list item; a numbered one shows its number as written (``1.``, Rich drops the dot)."""

    def render_number(
        self, console: Console, options: ConsoleOptions, number: int, last_number: int
    ) -> RenderResult:
        width = len(str(last_number)) + 2
        lines = console.render_lines(
            self.elements, options.update(width=options.max_width - width), style=self.style
        )
        style = console.get_style("markdown.item.number", default="none")
        numeral = Segment(f"{number}.".rjust(width - 1) + " ", style)
        padding = Segment(" " * width, style)
        for first, line in loop_first(lines):
            yield numeral if first else padding
            yield from line
            yield Segment.line()


class ParsedMarkdown(Markdown):
    """Rich's Markdown over tokens kvchat's parser made (Rich's own parser would read raw
    HTML as markup and build a parser per message); links show their address as text."""

    elements: ClassVar[dict[str, type[MarkdownElement]]] = {
        **Markdown.elements,
        "heading_open": _LeftHeading,
        "fence": _CodeBlock,
        "code_block": _CodeBlock,
        "list_item_open": _ListItem,
    }

    def __init__(self, tokens: list[Token], code_theme: str, code_background: str) -> None:
        # Not Markdown.__init__: it would parse a source; these are its attributes.
        self.markup = ""
        self.parsed = tokens
        self.code_theme = code_theme
        self.code_background = code_background
        self.justify = None
        self.style = "none"
        self.hyperlinks = False
        self.inline_code_lexer = None
        self.inline_code_theme = code_theme


def plain_autolinks(tokens: list[Token]) -> list[Token]:
    """Bare addresses (``https://…``, ``<https://…>``) stay as written: Rich would show
    each as its text followed by the same address in brackets."""
    for token in tokens:
        children = token.children
        if children and any(c.markup in ("linkify", "autolink") for c in children):
            token.children = [
                c
                for c in children
                if not (
                    c.type in ("link_open", "link_close") and c.markup in ("linkify", "autolink")
                )
            ]
    return tokens


def top_blocks(tokens: list[Token]) -> list[list[Token]]:
    """The tokens of each top-level block (a paragraph, a whole list, a fence…), in order."""
    blocks: list[list[Token]] = []
    for token in tokens:
        if token.level == 0 and token.nesting >= 0 or not blocks:
            blocks.append([token])
        else:
            blocks[-1].append(token)
    return blocks


def block_signature(block: list[Token]) -> tuple[tuple[str, str, str], ...]:
    return tuple((t.type, t.content, t.info) for t in block)


class MarkdownStyle:
    """The Markdown elements' colours from the app's theme, as a Rich theme."""

    def __init__(self, variables: dict[str, str], dark: bool) -> None:
        def parse(value: str, fallback: str) -> Color:
            try:
                return Color.parse(value)
            except Exception:
                return Color.parse(fallback)

        back = parse(variables.get("background", "#121212"), "#121212").with_alpha(1.0)
        fore = back + parse(variables.get("foreground", "#e0e0e0"), "#e0e0e0")

        def color(name: str, fallback: str) -> str:
            return (back + parse(variables.get(name, fallback), fallback)).hex6

        foreground = fore.hex6
        muted = back.blend(fore, 0.6).hex6
        code_background = back.blend(fore, 0.07).hex6
        faint = back.blend(fore, 0.3).hex6
        styles: dict[str, str | Style] = {
            "markdown.code": f"{color('text-warning', '#ffc473')} on {code_background}",
            "markdown.block_quote": f"italic {muted}",
            "markdown.link": f"underline {color('text-primary', '#57a5e2')}",
            "markdown.link_url": f"{muted}",
            "markdown.item.bullet": f"bold {color('text-accent', '#ffc473')}",
            "markdown.item.number": f"bold {color('text-accent', '#ffc473')}",
            "markdown.hr": faint,
            "markdown.table.border": faint,
            "markdown.table.header": "bold",
            "markdown.em": "italic",
            "markdown.strong": "bold",
            "markdown.s": "strike",
            "markdown.paragraph": "none",
            "markdown.text": "none",
        }
        for level in range(1, 7):
            style = variables.get(f"markdown-h{level}-text-style", "bold")
            heading = color(f"markdown-h{level}-color", foreground)
            styles[f"markdown.h{level}"] = f"{style} {heading}".strip()
        self.theme = Theme(styles, inherit=True)
        # A console of its own with the theme built in: rendering never pushes a theme on
        # the app's console.
        self.console = Console(
            file=io.StringIO(), theme=self.theme, force_terminal=True, color_system="truecolor"
        )
        self.code_theme = code_theme(dark)
        self.code_background = code_background


class Renderer:
    """Renders parsed Markdown into lines of one width (what it needs of the widget taken
    when made, so the parts of a long message rendered later use the same)."""

    def __init__(
        self, options: ConsoleOptions, style: MarkdownStyle, base: Style, width: int
    ) -> None:
        self.options, self.style, self.base, self.width = options, style, base, width

    def extend(self, lines: list[Strip], more: list[Strip]) -> None:
        """Add the lines of one more block (or part) to ``lines``, a blank line between."""
        if lines and more:
            lines.append(Strip.blank(self.width, self.base))
        lines += more

    def lines(self, tokens: list[Token]) -> list[Strip]:
        """The lines of ``tokens``, without the empty line Rich puts before a list (or a
        quote) that opens them."""
        style = self.style
        markdown = ParsedMarkdown(tokens, style.code_theme, style.code_background)
        lines = style.console.render_lines(markdown, self.options, style=self.base, pad=False)
        start = 0
        while start < len(lines) and not any(s.text for s in lines[start]):
            start += 1
        return [
            Strip(_plain(line)).extend_cell_length(self.width, self.base) for line in lines[start:]
        ]


def parts(source: str) -> Iterator[str]:
    """``source`` in parts of at least PART_CHARS, cut at blank lines outside fenced code
    (each part parses as the blocks it holds)."""
    start = 0
    fence = ""
    lines = source.split("\n")
    offset = 0
    for index, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = "" if fence == mark else fence or mark
        offset += len(line) + 1
        if not fence and not line.strip() and offset - start >= PART_CHARS:
            if index + 1 < len(lines):
                yield source[start:offset]
                start = offset
    if start < len(source):
        yield source[start:]


def _plain(line: Iterable[Segment]) -> list[Segment]:
    """Segments without Rich's control codes (Markdown renders none: the terminal never
    gets one from a message)."""
    return [s for s in line if not s.control]
