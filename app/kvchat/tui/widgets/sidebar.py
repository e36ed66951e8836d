"""The sessions sidebar: title, last updated, tokens and where each session's KV lives.

Forks and edits are shown as a tree under the session they were made from (Space on a
row folds or unfolds its branches); the open session's ancestors are never folded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.widgets import Label, ListItem, ListView

from kvchat.tui.phrases import KV_LABELS, ago, visible

if TYPE_CHECKING:
    from kvchat.service.chat import ChatService, SessionSummary


@dataclass(frozen=True)
class SessionRow:
    summary: SessionSummary
    kv: str  # hot / ram / disk / none
    context: int | None = None  # tokens in the live context (the open, hot session only)
    depth: int = 0  # how deep in its branch tree (0: a root)
    branches: int = 0  # its direct branches (forks and edits made from it)
    hidden: int = 0  # the branches folded away under it (all descendants), when folded

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

    @property
    def parent_id(self) -> str | None:
        return self.summary.session.parent_id

    @property
    def marker(self) -> str:
        """What goes before the title: indentation and "└" for a branch, "▾" for an
        unfolded parent, "▸ +N" for a folded one (N: the branches it hides)."""
        out = "  " * (self.depth - 1) + "└ " if self.depth else ""
        if self.hidden:
            out += f"▸ +{self.hidden} "
        elif self.branches:
            out += "▾ "
        return out


def branch_tree(rows: list[SessionRow], folded: set[str], current: str | None) -> list[SessionRow]:
    """``rows`` (most recently updated first) as a tree: each root in that order followed
    by its descendants depth-first (siblings in the same order). A row whose parent is not
    listed is a root. The descendants of a folded row are left out (its ``hidden`` counts
    them), except that the open session's ancestors are never folded."""
    by_id = {r.id: r for r in rows}
    children: dict[str, list[SessionRow]] = {}
    for r in rows:
        parent_id = r.parent_id
        if parent_id is not None and parent_id in by_id and parent_id != r.id:
            children.setdefault(parent_id, []).append(r)
    keep_open: set[str] = set()
    parent = by_id[current].parent_id if current is not None and current in by_id else None
    while parent is not None and parent in by_id and parent not in keep_open:
        keep_open.add(parent)
        parent = by_id[parent].parent_id
    seen: set[str] = set()

    def fold_away(row_id: str) -> int:
        """Leave out every descendant of ``row_id``; returns how many there were."""
        total, stack = 0, list(children.get(row_id, []))
        while stack:
            kid = stack.pop()
            if kid.id in seen:
                continue
            seen.add(kid.id)
            total += 1
            stack.extend(children.get(kid.id, []))
        return total

    out: list[SessionRow] = []
    # Roots first; then any row left out by a cycle of parents (not made by kvchat).
    roots = [r for r in rows if r.parent_id not in by_id or r.parent_id == r.id]
    for root in [*roots, *rows]:
        stack = [(root, 0)]
        while stack:
            row, depth = stack.pop()
            if row.id in seen:
                continue
            seen.add(row.id)
            kids = children.get(row.id, [])
            fold = bool(kids) and row.id in folded and row.id not in keep_open
            hidden = fold_away(row.id) if fold else 0
            out.append(replace(row, depth=depth, branches=len(kids), hidden=hidden))
            if not fold:
                stack.extend((kid, depth + 1) for kid in reversed(kids))
    return out


def session_rows(service: ChatService) -> list[SessionRow]:
    """On the store thread: every session, most recently updated first, with where its KV is."""
    return [SessionRow(s, service.kv_location(s.session.id)) for s in service.list_sessions()]


def with_context(rows: list[SessionRow], hot: str | None, used: int) -> list[SessionRow]:
    """The open, hot session's row (``hot``) with the context gauge's figure: one number for
    both."""
    if hot is None:
        return rows
    return [replace(r, context=used) if r.id == hot else r for r in rows]


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
        self._title_label.update(row.marker + visible(s.session.title))
        # The figure first: a narrow sidebar cuts the time, not the number.
        info = f"{row.tokens:,} tok · {ago(s.session.updated)}"
        self._info_label.update(info)
        badge = self._badge_label
        kind = row.badge
        badge.update(KV_LABELS.get(kind, kind))
        for kv in KV_LABELS:
            badge.set_class(kv == kind, f"kv-{kv}")


class SessionList(ListView):
    """Sessions, most recently updated first, each followed by its branches; selecting
    one opens it, Space folds or unfolds the branches under the highlighted one."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_branches", "Fold / unfold branches", show=False),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.rows: list[SessionRow] = []  # the rows shown, in order (folded ones left out)
        self.folded: set[str] = set()  # sessions whose branches are folded away
        self._all: list[SessionRow] = []
        self._current: str | None = None
        self._lock = asyncio.Lock()

    async def show(self, rows: list[SessionRow], current: str | None) -> None:
        """Replace the items, keeping the open session highlighted."""
        self._all, self._current = rows, current
        await self._layout(current)

    def action_toggle_branches(self) -> None:
        """Fold or unfold the branches under the highlighted session (on a branch without
        branches of its own: those of its parent). The open session stays visible."""
        row = self.rows[self.index] if self.index is not None and self.rows else None
        if row is not None and not row.branches:
            row = next((r for r in self.rows if r.id == row.parent_id), None)
        if row is None:
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
        # In a worker: the key returns at once, the items change on the next turn.
        self.run_worker(self._layout(row.id), group="fold", exit_on_error=False)

    async def _layout(self, highlighted: str | None) -> None:
        async with self._lock:
            rows = branch_tree(self._all, self.folded, self._current)
            items = list(self.query(SessionItem))
            if [i.session_id for i in items] == [r.id for r in rows]:
                for item, row in zip(items, rows):
                    item.update_row(row)  # same sessions, same order: no flicker
            else:
                await self.clear()
                await self.extend(SessionItem(row) for row in rows)
            self.rows = rows
            self.highlight(highlighted)

    def highlight(self, session_id: str | None) -> None:
        for i, row in enumerate(self.rows):
            if row.id == session_id:
                self.index = i
                return
        self.index = None
        if session_id is not None and any(r.id == session_id for r in self._all):
            # Opened while folded away (a search hit): unfold its ancestors now.
            self._current = session_id
            self.run_worker(self._layout(session_id), group="fold", exit_on_error=False)

    @property
    def newest(self) -> str | None:
        """The most recently updated session, folded away or not."""
        return self._all[0].id if self._all else None

    def row(self, session_id: str) -> SessionRow | None:
        return next((r for r in self.rows if r.id == session_id), None)
