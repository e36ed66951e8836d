"""Search every message (SQLite FTS5) and pick a hit to jump to."""

from __future__ import annotations

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

from kvchat.tui.format import shorten, visible

if TYPE_CHECKING:
    from kvchat.chat import SearchHit

_MARK = re.compile(r"\[([^\[\]]*)\]")

Searcher = Callable[[str], Awaitable[list["SearchHit"]]]


def hit_content(hit: SearchHit) -> Content:
    """ "Session title · role" over the snippet, with FTS5's [matches] highlighted."""
    head = Content.styled(shorten(hit.session_title, 40), "bold") + Content(
        f" · {'you' if hit.message.role == 'user' else hit.message.role}"
    )
    snippet = " ".join(visible(hit.snippet).split())
    parts: list[Content] = []
    pos = 0
    for m in _MARK.finditer(snippet):
        parts.append(Content(snippet[pos : m.start()]))
        parts.append(Content.styled(m.group(1), "reverse"))
        pos = m.end()
    parts.append(Content(snippet[pos:]))
    return Content("\n").join([head, Content("").join(parts)])


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
            self.run_search(self.query_text)

    @on(Input.Changed, "#query")
    def _changed(self, event: Input.Changed) -> None:
        self.run_search(event.value)

    @work(exclusive=True, group="search", exit_on_error=False)
    async def run_search(self, text: str) -> None:
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
        options.add_options(Option(hit_content(h), id=str(i)) for i, h in enumerate(hits))
        count = self.query_one("#search-count", Label)
        if not text.strip():
            count.update("Enter opens the selected hit · Esc closes")
        else:
            plural = "s" if len(hits) != 1 else ""
            count.update(f"{len(hits)} hit{plural} · Enter opens · Esc closes")

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
