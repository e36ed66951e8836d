"""The sessions sidebar: title, last updated, tokens and where each session's KV lives."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ListItem, ListView

from kvchat.tui.format import KV_LABELS, ago, visible

if TYPE_CHECKING:
    from kvchat.chat import SessionSummary


@dataclass(frozen=True)
class SessionRow:
    summary: SessionSummary
    kv: str  # hot / ram / disk / none
    context: int | None = None  # tokens in the live context (the open, hot session only)

    @property
    def id(self) -> str:
        return self.summary.session.id

    @property
    def tokens(self) -> int:
        """The session's size in tokens, the figure the context gauge shows for it: the live
        context when it is open, else its saved KV, else its messages' count."""
        if self.context is not None:
            return self.context
        return self.summary.snapshot_tokens or self.summary.tokens

    @property
    def badge(self) -> str:
        """Where its KV lives; ``none`` for a session with nothing in it, even the hot one."""
        if self.summary.messages == 0 or (self.kv == "hot" and self.tokens == 0):
            return "none"
        return self.kv


class SessionItem(ListItem):
    def __init__(self, row: SessionRow) -> None:
        super().__init__()
        self.row = row
        # Held, not queried: an item removed while it mounts has no children to find.
        self._title_label = Label(classes="session-title", markup=False)
        self._info_label = Label(classes="session-info")
        self._badge_label = Label(classes="kv-badge")

    @property
    def session_id(self) -> str:
        return self.row.id

    def compose(self) -> ComposeResult:
        yield self._title_label
        with Horizontal(classes="session-meta"):
            yield self._info_label
            yield self._badge_label

    def on_mount(self) -> None:
        self.update_row(self.row)

    def update_row(self, row: SessionRow) -> None:
        """Show ``row`` (same session) without rebuilding the item."""
        self.row = row
        s = row.summary
        self._title_label.update(visible(s.session.title))
        # The figure first: a narrow sidebar cuts the time, not the number.
        info = f"{row.tokens:,} tok · {ago(s.session.updated)}"
        self._info_label.update(info)
        badge = self._badge_label
        kind = row.badge
        badge.update(KV_LABELS.get(kind, kind))
        for kv in KV_LABELS:
            badge.set_class(kv == kind, f"kv-{kv}")


class SessionList(ListView):
    """Sessions, most recently updated first; selecting one opens it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rows: list[SessionRow] = []
        self._lock = asyncio.Lock()

    async def show(self, rows: list[SessionRow], current: str | None) -> None:
        """Replace the items, keeping the open session highlighted."""
        async with self._lock:
            items = list(self.query(SessionItem))
            if [i.session_id for i in items] == [r.id for r in rows]:
                for item, row in zip(items, rows):
                    item.update_row(row)  # same sessions, same order: no flicker
            else:
                await self.clear()
                await self.extend(SessionItem(row) for row in rows)
            self.rows = rows
            self.highlight(current)

    def highlight(self, session_id: str | None) -> None:
        for i, row in enumerate(self.rows):
            if row.id == session_id:
                self.index = i
                return
        self.index = None

    def row(self, session_id: str) -> SessionRow | None:
        return next((r for r in self.rows if r.id == session_id), None)
