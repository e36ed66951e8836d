"""Search every message (SQLite FTS5) and pick a hit to jump to."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from kvchat.text import visible
from kvchat.tui.phrases import shorten

if TYPE_CHECKING:
    from kvchat.service.chat import SearchHit

# Highlight markers the store's FTS snippet() may use: STX/ETX, which no typed text holds.
# Its older markers, "[" and "]", cannot be told from brackets in the text (``&[String]``),
# so a snippet without STX is rebuilt from the message and the query instead.
START, END = "\x02", "\x03"
_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")
SNIPPET_CHARS = 90
# Typing waits this long for the next key before it searches: a word typed fast is one
# query, not one per letter (each a full-text search, and an echo that waits for it).
DEBOUNCE_S = 0.15

Searcher = Callable[[str], Awaitable[list["SearchHit"]]]


def snippet_parts(hit: SearchHit, query: str) -> list[tuple[str, bool]]:
    """The snippet of a hit as (text, is a match) pieces, every character as written."""
    if START in hit.snippet:
        parts: list[tuple[str, bool]] = []
        for i, piece in enumerate(hit.snippet.split(START)):
            match, _, rest = piece.partition(END) if i else ("", "", piece)
            if match:
                parts.append((match, True))
            if rest:
                parts.append((rest, False))
        return parts
    return own_snippet(hit.message.content, query)


def own_snippet(text: str, query: str) -> list[tuple[str, bool]]:
    """A snippet of ``text`` around the first word that starts with a word of ``query``.

    FTS matches words by their stem, so a word that starts with a query word is a match here.
    """
    text = " ".join(text.split())
    terms = [t.lower() for t in _WORD.findall(query)]
    if not terms:
        return [(text[:SNIPPET_CHARS], False)]
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(t) for t in terms) + r")\w*", re.I)
    first = pattern.search(text)
    anchor, anchor_end = (first.start(), first.end()) if first else (0, 0)
    start = max(0, anchor - SNIPPET_CHARS // 3)
    if start:  # begin at a word
        space = text.find(" ", start, anchor)
        start = space + 1 if space != -1 else start
    end = min(len(text), start + SNIPPET_CHARS)
    if end < len(text):  # end at a word, after the first match
        space = text.rfind(" ", anchor_end, end)
        end = space if space != -1 else end
    window = text[start:end]
    parts: list[tuple[str, bool]] = [("…", False)] if start else []
    pos = 0
    for m in pattern.finditer(window):
        if m.start() > pos:
            parts.append((window[pos : m.start()], False))
        parts.append((m.group(0), True))
        pos = m.end()
    if pos < len(window):
        parts.append((window[pos:], False))
    if end < len(text):
        parts.append(("…", False))
    return parts


def hit_content(hit: SearchHit, query: str = "") -> Content:
    """ "Session title · role" over the snippet, its matches highlighted."""
    head = Content.styled(shorten(hit.session_title, 40), "bold") + Content(
        f" · {'you' if hit.message.role == 'user' else hit.message.role}"
    )
    pieces = [
        Content.styled(shown, "reverse") if match else Content(shown)
        for text, match in snippet_parts(hit, query)
        if (shown := _SPACE.sub(" ", visible(text)))
    ]
    return Content("\n").join([head, Content("").join(pieces)])


class SearchScreen(ModalScreen["SearchHit | None"]):
    """Type to search; Enter or ↓ goes to the results; Enter on a result jumps to it."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", show=False),
        Binding("down", "results", "Results", show=False),
    ]

    def __init__(self, searcher: Searcher, query: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.searcher = searcher
        self.query_text = query
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall"):
            yield Label("Search all messages", classes="dialog-title")
            yield Input(self.query_text, placeholder="words to find…", id="query")
            yield OptionList(id="hits")
            yield Label("", id="search-count", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#query", Input).focus()
        if self.query_text:
            self.run_search(self.query_text, wait=False)

    @on(Input.Changed, "#query")
    def _changed(self, event: Input.Changed) -> None:
        self.run_search(event.value)

    @work(exclusive=True, group="search", exit_on_error=False)
    async def run_search(self, text: str, wait: bool = True) -> None:
        """Search for ``text``; typed (``wait``), only once no key followed for DEBOUNCE_S
        (the next key's search cancels this one)."""
        if wait:
            await asyncio.sleep(DEBOUNCE_S)
        await self._search(text)

    async def _search(self, text: str) -> None:
        try:
            hits = await self.searcher(text) if text.strip() else []
        except Exception as exc:  # noqa: BLE001 - shown to the user; the dialog stays usable
            self.query_one("#search-count", Label).update(f"search failed: {exc}")
            return
        if text != self.query_one("#query", Input).value:
            return  # typed on meanwhile: a newer search follows
        self.hits = hits
        options = self.query_one("#hits", OptionList)
        options.clear_options()
        options.add_options(Option(hit_content(h, text), id=str(i)) for i, h in enumerate(hits))
        count = self.query_one("#search-count", Label)
        if not text.strip():
            count.update("Enter opens the selected hit · Esc closes")
        else:
            plural = "s" if len(hits) != 1 else ""
            count.update(f"{len(hits):,} hit{plural} · Enter opens · Esc closes")

    @on(Input.Submitted, "#query")
    async def _submitted(self, event: Input.Submitted) -> None:
        await self._search(event.value)
        if len(self.hits) == 1:
            self.dismiss(self.hits[0])
        else:
            self.action_results()

    def action_results(self) -> None:
        options = self.query_one("#hits", OptionList)
        if options.option_count:
            options.focus()
            if options.highlighted is None:
                options.highlighted = 0

    @on(OptionList.OptionSelected, "#hits")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.hits[int(event.option.id or 0)])

    def action_cancel(self) -> None:
        self.dismiss(None)
