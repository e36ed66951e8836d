"""The sessions sidebar: title, tokens, last updated and where each session's KV lives.

A line-API widget: it draws only the lines on screen, whatever the number of sessions
(no widget per session), and a change to one session redraws that row alone. Sessions
are grouped by date (Today, Yesterday, Previous 7 days, then by month), each followed by
its branches (Space folds or unfolds them); pinned sessions come first, under their own
header. ``/`` (or Shift+F2 from anywhere) filters by title and ``#tag`` as you type (Esc
clears the filter). Enter or a click opens the highlighted session. Any other printable
key goes to the input, as typed.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvchat.text import visible
from kvchat.tui.phrases import KV_LABELS, ago
from kvchat.tui.session_rows import SessionRow, branch_tree, date_group, local_offset

# The header over the pinned sessions, listed before the dated groups.
PINNED = "Pinned"


@dataclass(frozen=True)
class ListLine:
    """One entry of the list as laid out: a date header (one line), a session (two lines)
    or the filter being typed (one line, on top)."""

    kind: str  # "header", "session" or "filter"
    text: str  # the header's label or the filter's text ("" for a session)
    row: SessionRow | None = None

    @property
    def height(self) -> int:
        return 2 if self.kind == "session" else 1


def row_lines(row: SessionRow) -> tuple[str, str, str]:
    """What a session's row says: its title line, its info line and its KV badge."""
    session = row.summary.session
    title = row.marker + ("★ " if session.pinned else "") + visible(session.title)
    # The figure first: a narrow sidebar cuts the time (then the tags), not the number.
    info = f"{row.tokens:,} tok · {ago(session.updated)}"
    if session.tags:
        info += " · " + " ".join(f"#{t}" for t in session.tags)
    badge = KV_LABELS.get(row.badge, row.badge)
    return title, info, badge


def matches(row: SessionRow, words: list[str]) -> bool:
    """Whether ``row`` is kept by a filter of ``words`` (casefolded): each ``#word`` must
    begin one of its tags (``#`` alone: any tag), every other word must be in its title."""
    session = row.summary.session
    title: str | None = None
    for word in words:
        if word.startswith("#"):
            if not any(t.startswith(word[1:]) for t in session.tags):
                return False
        else:
            if title is None:
                title = visible(session.title).casefold()
            if word not in title:
                return False
    return True


def pinned_first(rows: list[SessionRow]) -> list[SessionRow]:
    """``rows`` as laid out (each root followed by its branches) with the pinned roots and
    their branches moved first, in the same order; a pinned branch stays in its tree."""
    pinned: list[SessionRow] = []
    others: list[SessionRow] = []
    into = others
    for row in rows:
        if row.depth == 0:
            into = pinned if row.summary.session.pinned else others
        into.append(row)
    return pinned + others if pinned else rows


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` cells, with an ellipsis when cut."""
    if width <= 0:
        return ""
    if cell_len(text) <= width:
        return text
    return set_cell_size(text, width - 1) + "…"


class SessionList(ScrollView, can_focus=True):
    """Sessions, most recently updated first under date headers, each followed by its
    branches (see the module docstring)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "session-list--cursor",
        "session-list--title",
        "session-list--info",
        "session-list--header",
        "session-list--filter",
        "session-list--kv-hot",
        "session-list--kv-ram",
        "session-list--kv-disk",
        "session-list--kv-none",
    }
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor(-1)", "Previous session", show=False),
        Binding("down", "cursor(1)", "Next session", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(-1)", "First session", show=False),
        Binding("end", "edge(1)", "Last session", show=False),
        Binding("enter", "select", "Open the session", show=False),
        Binding("space", "toggle_branches", "Fold / unfold branches", show=False),
        Binding("slash", "filter", "Filter the titles", show=False),
    ]

    @dataclass
    class Picked(Message):
        """Enter or a click on a session: open it."""

        session_id: str

    @dataclass
    class TypedAhead(Message):
        """A printable key typed on the list (not filtering): it belongs in the input."""

        character: str

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.rows: list[SessionRow] = []  # the sessions shown, in order (folded ones left out)
        self.folded: set[str] = set()  # sessions whose branches are folded away
        self.filter_text: str | None = None  # None: not filtering
        self._all: list[SessionRow] = []
        self._current: str | None = None
        self._lines: list[ListLine] = []
        self._starts: list[int] = []  # the first line of each entry of _lines
        self._entry_of: dict[str, int] = {}  # session id -> entry index
        self._cursor: int | None = None  # the highlighted entry (a session)
        self._parts: dict[tuple[object, ...], Style] = {}  # component styles (see _part)

    # --- what the screen calls ------------------------------------------------------------

    async def show(self, rows: list[SessionRow], current: str | None) -> None:
        """Show ``rows`` (every session, most recently updated first), keeping the open
        session ``current`` highlighted. Rows that did not change are not redrawn."""
        self._all, self._current = rows, current
        self._layout(current)

    def highlight(self, session_id: str | None) -> None:
        """Highlight ``session_id`` (unfolding its ancestors if it is folded away)."""
        entry = self._entry_of.get(session_id) if session_id is not None else None
        if entry is not None:
            self._move_cursor(entry)
            return
        self._move_cursor(None)
        if session_id is not None and self.filter_text is None:
            if any(r.id == session_id for r in self._all):
                # Opened while folded away (a search hit): unfold its ancestors now.
                self._current = session_id
                self._layout(session_id)

    def row(self, session_id: str) -> SessionRow | None:
        entry = self._entry_of.get(session_id)
        return self._lines[entry].row if entry is not None else None

    @property
    def newest(self) -> str | None:
        """The most recently updated session, folded away or not."""
        return self._all[0].id if self._all else None

    @property
    def index(self) -> int | None:
        """The highlighted session's position in :attr:`rows`."""
        entry = self._cursor
        if entry is None:
            return None
        row = self._lines[entry].row
        if row is None:
            return None
        return next((i for i, r in enumerate(self.rows) if r.id == row.id), None)

    @index.setter
    def index(self, value: int | None) -> None:
        if value is None or not 0 <= value < len(self.rows):
            self._move_cursor(None)
        else:
            self._move_cursor(self._entry_of[self.rows[value].id])

    @property
    def line_count(self) -> int:
        """Lines of the whole list (what scrolling covers); only those on screen are drawn."""
        return self._starts[-1] + self._lines[-1].height if self._lines else 0

    # --- layout -----------------------------------------------------------------------------

    def _layout(self, highlighted: str | None) -> None:
        """Arrange the rows (tree, folds, filter, date groups); redraw only what changed."""
        if self.filter_text is None:
            rows = pinned_first(branch_tree(self._all, self.folded, self._current))
        else:
            words = self.filter_text.casefold().split()
            rows = pinned_first([r for r in self._all if matches(r, words)])
        lines: list[ListLine] = []
        if self.filter_text is not None:
            lines.append(ListLine("filter", self.filter_text))
        group, offset = None, local_offset()
        today = (datetime.now(UTC).replace(tzinfo=None) + offset).date()
        for row in rows:
            if row.depth == 0:
                if row.summary.session.pinned:
                    label = PINNED
                else:
                    label = date_group(row.summary.session.updated, today, offset)
                if label != group:
                    group = label
                    lines.append(ListLine("header", label))
            lines.append(ListLine("session", "", row))
        old = self._lines
        self.rows = rows
        if [(x.kind, x.text, x.row.id if x.row else None) for x in old] == [
            (x.kind, x.text, x.row.id if x.row else None) for x in lines
        ]:
            # The same entries in the same order: redraw the rows that changed, only.
            for entry, (before, now) in enumerate(zip(old, lines)):
                if before.row is not now.row and before.row != now.row:
                    self._lines[entry] = now
                    self.refresh_lines(self._starts[entry], now.height)
        else:
            self._lines = lines
            starts, line = [], 0
            for entry_line in lines:
                starts.append(line)
                line += entry_line.height
            self._starts = starts
            self._entry_of = {x.row.id: i for i, x in enumerate(lines) if x.row is not None}
            self._cursor = None
            self.virtual_size = Size(0, line)
            self.refresh()
        if highlighted in self._entry_of:
            self._move_cursor(self._entry_of[highlighted])
        elif self._cursor is not None and self._cursor >= len(self._lines):
            self._move_cursor(None)

    def _entry_at(self, line: int) -> int | None:
        """The entry drawn at virtual line ``line``."""
        if not self._starts or line < 0 or line >= self.line_count:
            return None
        return bisect_right(self._starts, line) - 1

    # --- the cursor -----------------------------------------------------------------------------

    def _move_cursor(self, entry: int | None, scroll: bool = True) -> None:
        before = self._cursor
        self._cursor = entry
        for changed in {before, entry}:
            if changed is not None and changed < len(self._lines):
                self.refresh_lines(self._starts[changed], self._lines[changed].height)
        if entry is not None and scroll and self.is_mounted:
            start, height = self._starts[entry], self._lines[entry].height
            if entry > 0 and self._lines[entry - 1].kind == "header":
                start, height = start - 1, height + 1  # its date header with it
            self.scroll_to_region(
                Region(0, start, 1, height), animate=False, force=True, immediate=True
            )

    def _sessions(self) -> list[int]:
        return [i for i, x in enumerate(self._lines) if x.kind == "session"]

    def action_cursor(self, step: int) -> None:
        entries = self._sessions()
        if not entries:
            return
        if self._cursor is None or self._cursor not in entries:
            self._move_cursor(entries[0] if step > 0 else entries[-1])
            return
        at = entries.index(self._cursor) + step
        self._move_cursor(entries[max(0, min(len(entries) - 1, at))])

    def action_page(self, direction: int) -> None:
        rows_per_page = max(1, self.scrollable_content_region.height // 2)
        self.action_cursor(direction * rows_per_page)

    def action_edge(self, direction: int) -> None:
        entries = self._sessions()
        if entries:
            self._move_cursor(entries[0] if direction < 0 else entries[-1])

    def action_select(self) -> None:
        entry = self._cursor
        row = self._lines[entry].row if entry is not None else None
        if row is not None:
            self.post_message(self.Picked(row.id))

    async def _on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        entry = self._entry_at(offset.y + self.scroll_offset.y)
        if entry is not None and self._lines[entry].kind == "session":
            self._move_cursor(entry, scroll=False)
            self.action_select()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    # --- folds and the filter -----------------------------------------------------------------

    def action_toggle_branches(self) -> None:
        """Fold or unfold the branches under the highlighted session (on a branch without
        branches of its own: those of its parent). The open session stays visible."""
        index = self.index
        row = self.rows[index] if index is not None and self.rows else None
        if row is not None and not row.branches:
            row = next((r for r in self.rows if r.id == row.parent_id), None)
        if row is None or self.filter_text is not None:
            self.app.bell()
            return
        if row.id in self.folded:
            self.folded.discard(row.id)
        else:
            self.folded.add(row.id)
            tree = branch_tree(self._all, self.folded, self._current)
            if not any(r.id == row.id and r.hidden for r in tree):
                self.folded.discard(row.id)
                self.notify("The open session's branch stays unfolded", timeout=3)
                return
        self._layout(row.id)

    def action_filter(self) -> None:
        """``/``: filter the titles as you type (Esc clears the filter)."""
        if self.filter_text is None:
            self.filter_text = ""
            self._layout(self._highlighted_id())

    def _highlighted_id(self) -> str | None:
        entry = self._cursor
        row = self._lines[entry].row if entry is not None else None
        return row.id if row is not None else None

    def _set_filter(self, text: str | None) -> None:
        self.filter_text = text
        # Leaving the filter keeps the session picked in it highlighted (else the open one).
        keep = (self._highlighted_id() or self._current) if text is None else None
        self._layout(keep)
        if text and self._cursor is None:
            self.action_edge(-1)  # the best match first

    async def _on_key(self, event: events.Key) -> None:
        if self.filter_text is None:
            if event.is_printable and event.character and event.key not in ("space", "slash"):
                # Typing here, not filtering: the text belongs in the input.
                event.stop()
                event.prevent_default()
                self.post_message(self.TypedAhead(event.character))
            return
        if event.key == "escape":
            self._set_filter(None)
        elif event.key == "backspace":
            self._set_filter(self.filter_text[:-1])
        elif event.is_printable and event.character and event.key != "space":
            self._set_filter(self.filter_text + event.character)
        elif event.key == "space":
            self._set_filter(self.filter_text + " ")
        else:
            return
        event.stop()
        event.prevent_default()

    # --- drawing ----------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.rich_style
        line = y + self.scroll_offset.y
        entry = self._entry_at(line)
        if entry is None:
            return Strip.blank(width, base)
        item = self._lines[entry]
        if item.kind == "header":
            style = base + self._part("session-list--header")
            return self._strip([(f" {item.text}", style)], width, base)
        if item.kind == "filter":
            style = base + self._part("session-list--filter")
            if not item.text:  # what it takes, until something is typed
                hint = base + self._part("session-list--info")
                return self._strip([(" / ▏", style), ("title or #tag · Esc", hint)], width, base)
            return self._strip([(f" / {item.text}▏", style)], width, base)
        assert item.row is not None
        if entry == self._cursor:
            base = base + self._part("session-list--cursor")
        title, info, badge = row_lines(item.row)
        inner = width - 2
        if line == self._starts[entry]:
            style = base + self._part("session-list--title")
            return self._strip([(" " + _fit(title, inner), style)], width, base)
        kind = item.row.badge
        badge_style = base + self._part(f"session-list--kv-{kind if kind in KV_LABELS else 'none'}")
        badge_text = f" {badge} "
        info_style = base + self._part("session-list--info")
        room = max(0, inner - cell_len(badge_text) - 1)
        info_text = _fit(info, room)
        gap = " " * max(1, inner - cell_len(info_text) - cell_len(badge_text) + 1)
        return self._strip(
            [(" " + info_text, info_style), (gap, base), (badge_text, badge_style)], width, base
        )

    def _part(self, name: str) -> Style:
        """A component's style (partial), looked up once per theme, focus and classes:
        Textual empties its own cache whenever the list's styles are updated, which a switch
        does, and rebuilding it (~0.2 ms a style under the profiler, several per line) was
        ~6% of a switch's frame."""
        key = (name, self.app.theme, self.has_focus, self.classes)
        style = self._parts.get(key)
        if style is None:
            style = self._parts[key] = self.get_component_rich_style(name, partial=True)
        return style

    @staticmethod
    def _strip(parts: list[tuple[str, Style]], width: int, base: Style) -> Strip:
        return Strip([Segment(text, style) for text, style in parts]).crop_extend(0, width, base)
