"""A message's Markdown as one widget that draws lines (Textual's line API).

Textual's Markdown widget mounts a widget per block (paragraph, list item, fence…): a page
of a dozen messages was ~280 widgets to style, lay out and composite, which was most of a
session switch's time. This body is one widget: its Markdown is parsed with kvchat's
parsers (raw HTML and character references stay text) and rendered by Rich into lines
(``markdown_render.py``), once per width, and :meth:`MessageBody.render_line` hands those
lines out. A reply
streaming in re-renders only its last block (the ones before it are kept as lines), and
lays the screen out again only when its number of lines changes (it grows by STREAM_SLACK
lines at a time); a very long message renders a part at a time between keys and frames,
with a note in its place until done.
A subclass can draw lines above and below the Markdown (:meth:`MessageBody._head`,
:meth:`MessageBody._foot`): a message's role line, its folded reasoning, a fold note, so a
message is one widget (a container and its children cost three times as much to lay out and
composite at each switch). The Markdown rendering (``markdown_render.py``: Rich's Markdown
imports Pygments) is imported when a body first renders, not with this module: the app's
first frame needs none of it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from textual.selection import Selection

    from kvchat.tui.widgets.markdown_render import MarkdownStyle, Renderer

# A source longer than this renders a part at a time (see markdown_render.parts), keys and
# frames between (a note shows until it is done): Rich renders ~0.5 MB of Markdown a second
# here, and the app must keep taking keys.
PARTS_CHARS = 32_000
# Parts are rendered for PART_S at most, then the loop has PAUSE_S for keys and frames.
PART_S = 0.010
PAUSE_S = 0.004
# While a reply streams in, its body ends in blank lines up to a multiple of this many: the
# screen is laid out again once every STREAM_SLACK lines the reply gains, not at each one.
STREAM_SLACK = 4
# The Markdown rendered last, shared by every body, up to this many sources: a message
# mounted again (a switch back to its session, a page scrolled to again) takes its lines
# from here. Rendering them was most of a switch's layout (~2 ms for a reply with a list
# and code, a dozen replies on a screen).
SHARED_RENDERS = 256
# No lines above or below the Markdown: one list, never changed, so that the joined lines
# are reused while nothing changes (see MessageBody._drawn).
NO_LINES: list[Strip] = []
_shared: OrderedDict[tuple[object, ...], list[Strip]] = OrderedDict()


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
        # The head, Markdown and foot lists last joined, and the joined lines (see _drawn).
        self._drawn_key: tuple[list[Strip], list[Strip], list[Strip], list[Strip]] | None = None

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
        """The source changed: render it again (see :meth:`_redraw`)."""
        self._lines = None
        self._redraw()

    def _redraw(self) -> None:
        """Redraw (the source changed, or a subclass's lines above or below it); lay the
        screen out again only if the number of lines drawn changed (a reply streaming in
        mostly adds words to its last line, and a layout pass of the whole screen at every
        piece would delay each key typed meanwhile)."""
        known, width = self._drawn_key, self.content_region.width
        if known is not None and width and len(self._source) <= PARTS_CHARS:
            if len(self._drawn(width)) == len(known[3]):
                self.refresh()
                return
        self.refresh(layout=True)

    @property
    def rendered(self) -> bool:
        """Its lines are rendered for its width (not a note that they are being drawn)."""
        return self._lines is not None and self._rendering is None

    @property
    def shown_text(self) -> str:
        """The Markdown as it shows at its width, as plain text (lines without trailing
        spaces; not the lines a subclass draws above or below it)."""
        width = self.content_region.width or self.size.width
        if not width:
            return ""
        return _plain(self._lines_for(width))

    @property
    def drawn_text(self) -> str:
        """Every line it draws at its width, as plain text (what a mouse selection reads)."""
        width = self.content_region.width or self.size.width
        return _plain(self._drawn(width)) if width else ""

    # --- lines above and below the Markdown (for a subclass) ---------------------------------

    def _head(self, width: int) -> list[Strip]:
        """Lines drawn above the Markdown (none here). A subclass caches what it returns:
        the same list object while nothing changed (NO_LINES for none)."""
        return NO_LINES

    def _foot(self, width: int) -> list[Strip]:
        """Lines drawn below the Markdown (none here); cached as :meth:`_head`'s."""
        return NO_LINES

    def _drawn(self, width: int) -> list[Strip]:
        """The head, the Markdown's lines and the foot, joined once while none changes
        (render_line asks for them at every line it draws)."""
        head, body, foot = self._head(width), self._lines_for(width), self._foot(width)
        known = self._drawn_key
        if known is None or known[0] is not head or known[1] is not body or known[2] is not foot:
            drawn = head + body + foot if head or foot else body
            known = self._drawn_key = (head, body, foot, drawn)
        return known[3]

    # --- rendering ---------------------------------------------------------------------------

    def _style(self) -> MarkdownStyle:
        from kvchat.tui.widgets.markdown_render import MarkdownStyle

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
        self._lines, self._lines_key = self._rendered(width, base), key
        return self._lines

    def _rendered(self, width: int, base: Style) -> list[Strip]:
        """The source's lines: from the shared renders when the same source was rendered
        at this width and style (not while streaming: a stream keeps its own blocks)."""
        if self._streaming:
            return self._render(self._renderer(width, base))
        key = (self._source, self._parser_factory, width, self.app.theme, base)
        lines = _shared.get(key)
        if lines is not None:
            _shared.move_to_end(key)
            return lines
        lines = _shared[key] = self._render(self._renderer(width, base))
        if len(_shared) > SHARED_RENDERS:
            _shared.popitem(last=False)
        return lines

    def _renderer(self, width: int, base: Style) -> Renderer:
        from kvchat.tui.widgets.markdown_render import Renderer

        app = self.app
        options = app.console_options.update(width=width, height=None, highlight=False)
        return Renderer(options, self._style(), base, width)

    def _render(self, renderer: Renderer) -> list[Strip]:
        if not self._source:
            return []
        from kvchat.tui.widgets.markdown_render import block_signature, plain_autolinks, top_blocks

        tokens = plain_autolinks(self._parser_factory().parse(self._source))
        if not self._streaming:
            return renderer.lines(tokens)
        # Streaming: the blocks before the last one are done; each is rendered once.
        blocks = top_blocks(tokens)
        done: dict[tuple[object, ...], list[Strip]] = {}
        lines: list[Strip] = []
        for index, block in enumerate(blocks):
            key = (renderer.width, renderer.base, block_signature(block))
            last = index == len(blocks) - 1
            rendered = None if last else self._done.get(key)
            if rendered is None:
                rendered = renderer.lines(block)
            if not last:
                done[key] = rendered
            renderer.extend(lines, rendered)
        self._done = done
        slack = -len(lines) % STREAM_SLACK
        return lines + [Strip.blank(renderer.width, renderer.base)] * slack

    def _render_in_parts(self, key: tuple[object, ...], renderer: Renderer) -> None:
        """Render a very long source a part at a time on the UI loop, keys and frames
        between the parts (a thread would hold the GIL: the UI would starve as much)."""
        from kvchat.tui.widgets.markdown_render import parts, plain_autolinks

        source, parser = self._source, self._parser_factory

        async def render() -> None:
            lines: list[Strip] = []
            since = time.perf_counter()
            for part in parts(source):
                renderer.extend(lines, renderer.lines(plain_autolinks(parser().parse(part))))
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
        return len(self._drawn(width)) if width > 0 else 0

    def render_line(self, y: int) -> Strip:
        width = self.content_region.width or self.size.width
        lines = self._drawn(width)
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
        return selection.extract(self.drawn_text), "\n"

    def selection_updated(self, selection: Selection | None) -> None:
        self.refresh()


class BodyStream:
    """A reply streaming into a :class:`MessageBody` (what ``Markdown.get_stream`` was)."""

    def __init__(self, body: MessageBody) -> None:
        self.body = body

    async def write(self, text: str) -> None:
        self.body.append(text)

    async def stop(self) -> None:
        self.body.stop_stream()


def _note(text: str, width: int, base: Style) -> Strip:
    return Strip([Segment(text[:width], base + Style(italic=True))]).extend_cell_length(width, base)


def _plain(lines: list[Strip]) -> str:
    return "\n".join(line.text.rstrip() for line in lines)
