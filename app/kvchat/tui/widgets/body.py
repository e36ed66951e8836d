"""A message's Markdown as one widget that draws lines (Textual's line API).

Textual's Markdown widget mounts a widget per block (paragraph, list item, fence…): a page
of a dozen messages was ~280 widgets to style, lay out and composite, which was most of a
session switch's time. This body is one widget: its Markdown is parsed with kvchat's
parsers (raw HTML and character references stay text) and rendered by Rich into lines,
once per width, and :meth:`MessageBody.render_line` hands those lines out. A reply
streaming in re-renders only its last block (the ones before it are kept as lines), and
lays the screen out again only when its number of lines changes (it grows by STREAM_SLACK
lines at a time); a very long message renders a part at a time between keys and frames,
with a note in its place until done.
Imported on first use (see ``message_view.py``): Rich's Markdown imports Pygments.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from rich._loop import loop_first
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markdown import CodeBlock, Heading, ListItem, Markdown, MarkdownElement
from rich.segment import Segment
from rich.style import Style
from rich.syntax import Syntax
from rich.theme import Theme
from textual.color import Color
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.token import Token
    from textual.selection import Selection

# A source longer than this renders a part of about PART_CHARS at a time, with keys and
# frames between (a note shows until it is done): Rich renders ~0.5 MB of Markdown a second
# here, and the app must keep taking keys.
PARTS_CHARS = 32_000
PART_CHARS = 2_000
# Parts are rendered for PART_S at most, then the loop has PAUSE_S for keys and frames.
PART_S = 0.010
PAUSE_S = 0.004
# While a reply streams in, its body ends in blank lines up to a multiple of this many: the
# screen is laid out again once every STREAM_SLACK lines the reply gains, not at each one.
STREAM_SLACK = 4


# Code blocks in these languages are highlighted without a pause the first time one is
# drawn: their lexers are loaded (and their patterns compiled) by warm_highlighting().
WARM_LANGUAGES = ("python", "bash", "javascript", "json", "text")


def warm_highlighting(code_theme: str = "monokai") -> None:
    """Load the lexers of WARM_LANGUAGES and ``code_theme`` now (the app does it in a thread
    once it is up): the first Python block drawn took 26 ms more than the next, and the
    first switch to a session with one was the slowest."""
    from pygments.lexers import get_lexer_by_name
    from pygments.styles import get_style_by_name

    get_style_by_name(code_theme)
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


def _signature(block: list[Token]) -> tuple[tuple[str, str, str], ...]:
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
        self.code_theme = "monokai" if dark else "default"
        self.code_background = code_background


class MessageBody(Widget):
    """Markdown drawn as lines (see the module docstring); ``source`` is what it shows."""

    DEFAULT_CSS = """
    MessageBody {
        height: auto;
    }
    """
    _styles_by_theme: ClassVar[dict[str, MarkdownStyle]] = {}

    def __init__(
        self,
        source: str = "",
        *,
        parser_factory: Callable[[], MarkdownIt],
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(id=id, classes=classes)
        self._source = source
        self._parser_factory = parser_factory
        self._streaming = False
        # Lines rendered for (width, source, theme, style), and the kept lines of a
        # streaming reply's finished blocks (the key of what they were rendered from).
        self._lines: list[Strip] | None = None
        self._lines_key: tuple[object, ...] | None = None
        self._done: dict[tuple[object, ...], list[Strip]] = {}  # finished blocks' lines
        self._rendering: tuple[object, ...] | None = None  # being rendered in parts

    @property
    def source(self) -> str:
        """The Markdown shown."""
        return self._source

    def update(self, source: str) -> None:
        """Show ``source`` instead (redrawn, and laid out again, on the next frame)."""
        if source != self._source:
            self._source = source
            self._changed()

    def append(self, text: str) -> None:
        """Add ``text`` to the end (a streamed reply)."""
        if text:
            self._source += text
            self._changed()

    def start_stream(self) -> BodyStream:
        """Stream into this body: until the stream stops, only its last block re-renders."""
        self._streaming = True
        return BodyStream(self)

    def stop_stream(self) -> None:
        if self._streaming:
            self._streaming = False
            self._done = {}
            self._changed()

    def _changed(self) -> None:
        """Redraw; lay the screen out again only if the number of lines changed (a reply
        streaming in mostly adds words to its last line, and a layout pass of the whole
        screen at every piece would delay each key typed meanwhile)."""
        before = self._lines
        self._lines = None
        width = self.content_region.width
        if before is not None and width and len(self._source) <= PARTS_CHARS:
            if len(self._lines_for(width)) == len(before):
                self.refresh()
                return
        self.refresh(layout=True)

    @property
    def rendered(self) -> bool:
        """Its lines are rendered for its width (not a note that they are being drawn)."""
        return self._lines is not None and self._rendering is None

    @property
    def shown_text(self) -> str:
        """What it shows at its width, as plain text (lines without trailing spaces)."""
        width = self.content_region.width or self.size.width
        if not width:
            return ""
        return "\n".join(line.text.rstrip() for line in self._lines_for(width))

    # --- rendering ---------------------------------------------------------------------------

    def _style(self) -> MarkdownStyle:
        app = self.app
        style = self._styles_by_theme.get(app.theme)
        if style is None:
            style = MarkdownStyle(app.theme_variables, app.current_theme.dark)
            self._styles_by_theme[app.theme] = style
        return style

    def _lines_for(self, width: int) -> list[Strip]:
        """The lines at ``width``: rendered now, cached, or (a very long source) a note
        while its parts are rendered."""
        base = self.visual_style.rich_style
        key = (width, len(self._source), hash(self._source), self.app.theme, base)
        if self._lines is not None and self._lines_key == key:
            return self._lines
        if len(self._source) > PARTS_CHARS:
            if self._rendering != key:
                self._rendering = key
                self._render_in_parts(key, self._renderer(width, base))
            if self._lines is not None:
                return self._lines  # the old lines until the new ones are ready
            return [_note(f"⋯ drawing {len(self._source):,} characters…", width, base)]
        self._lines, self._lines_key = self._render(self._renderer(width, base)), key
        return self._lines

    def _renderer(self, width: int, base: Style) -> _Renderer:
        app = self.app
        options = app.console_options.update(width=width, height=None, highlight=False)
        return _Renderer(options, self._style(), base, width)

    def _render(self, renderer: _Renderer) -> list[Strip]:
        if not self._source:
            return []
        tokens = plain_autolinks(self._parser_factory().parse(self._source))
        if not self._streaming:
            return renderer.lines(tokens)
        # Streaming: the blocks before the last one are done; each is rendered once.
        blocks = top_blocks(tokens)
        done: dict[tuple[object, ...], list[Strip]] = {}
        lines: list[Strip] = []
        for index, block in enumerate(blocks):
            key = (renderer.width, renderer.base, _signature(block))
            last = index == len(blocks) - 1
            rendered = None if last else self._done.get(key)
            if rendered is None:
                rendered = renderer.lines(block)
            if not last:
                done[key] = rendered
            if lines and rendered:
                lines.append(Strip.blank(renderer.width, renderer.base))
            lines += rendered
        self._done = done
        slack = -len(lines) % STREAM_SLACK
        return lines + [Strip.blank(renderer.width, renderer.base)] * slack

    def _render_in_parts(self, key: tuple[object, ...], renderer: _Renderer) -> None:
        """Render a very long source a part at a time on the UI loop, keys and frames
        between the parts (a thread would hold the GIL: the UI would starve as much)."""
        source, parser = self._source, self._parser_factory

        async def render() -> None:
            lines: list[Strip] = []
            since = time.perf_counter()
            for part in parts(source):
                rendered = renderer.lines(plain_autolinks(parser().parse(part)))
                if lines and rendered:
                    lines.append(Strip.blank(renderer.width, renderer.base))
                lines += rendered
                if time.perf_counter() - since > PART_S:
                    await asyncio.sleep(PAUSE_S)  # a key's way to the input takes a few hops
                    since = time.perf_counter()
                    if self._rendering != key:
                        return  # changed, or laid out at another width: that render goes on
            self._lines, self._lines_key, self._rendering = lines, key, None
            self.refresh(layout=True)

        self.run_worker(render(), exclusive=True, group="body", exit_on_error=False)

    # --- the line API ------------------------------------------------------------------------

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return container.width

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lines_for(width)) if width > 0 else 0

    def render_line(self, y: int) -> Strip:
        width = self.content_region.width or self.size.width
        lines = self._lines_for(width)
        if y >= len(lines):
            return Strip.blank(width, self.visual_style.rich_style)
        line = lines[y]
        selection = self.text_selection
        if selection is not None and (span := selection.get_span(y)) is not None:
            start, end = span
            end = line.cell_length if end == -1 else end
            chosen = self.screen.get_component_rich_style("screen--selection")
            line = Strip.join(
                [line.crop(0, start), line.crop(start, end).apply_style(chosen), line.crop(end)]
            )
        return line

    def get_selection(self, selection: Selection) -> tuple[str, str] | None:
        return selection.extract(self.shown_text), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self.refresh()


class _Renderer:
    """Renders parsed Markdown into lines of one width (what it needs of the widget taken
    when made, so the parts of a long message rendered later use the same)."""

    def __init__(
        self, options: ConsoleOptions, style: MarkdownStyle, base: Style, width: int
    ) -> None:
        self.options, self.style, self.base, self.width = options, style, base, width

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


class BodyStream:
    """A reply streaming into a :class:`MessageBody` (what ``Markdown.get_stream`` was)."""

    def __init__(self, body: MessageBody) -> None:
        self.body = body

    async def write(self, text: str) -> None:
        self.body.append(text)

    async def stop(self) -> None:
        self.body.stop_stream()


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


def _note(text: str, width: int, base: Style) -> Strip:
    return Strip([Segment(text[:width], base + Style(italic=True))]).extend_cell_length(width, base)
