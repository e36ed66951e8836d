"""The sessions list as data: one row per session, arranged as a tree of branches and
grouped by date, with no UI in it (the sidebar widget draws what this arranges).

Forks and edits are shown as a tree under the session they were made from; the open
session's ancestors are never folded. Roots come most recently updated first, grouped as
chat apps do: Today, Yesterday, Previous 7 days, then by month.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.service.chat import SessionSummary


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
        context when it is open, else ``SessionSummary.size`` (its saved KV, else its
        messages' counts), the figure ``kvchat list`` shows."""
        if self.context:  # an empty context (nothing read yet) says nothing of the size
            return self.context
        return self.summary.size

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
            if (row.depth, row.branches, row.hidden) == (depth, len(kids), hidden):
                out.append(row)  # most rows: a root without branches, as it came
            else:
                out.append(replace(row, depth=depth, branches=len(kids), hidden=hidden))
            if not fold:
                stack.extend((kid, depth + 1) for kid in reversed(kids))
    return out


def with_context(rows: list[SessionRow], hot: str | None, used: int) -> list[SessionRow]:
    """The open, hot session's row (``hot``) with the context gauge's figure: one number for
    both."""
    if hot is None:
        return rows
    return [replace(r, context=used) if r.id == hot else r for r in rows]


def date_group(stamp: str, today: date | None = None, offset: timedelta | None = None) -> str:
    """The group a session updated at ``stamp`` (UTC, ISO) is listed under, by local date:
    "Today", "Yesterday", "Previous 7 days", else its month ("March 2026"). ``offset``: the
    local time's offset from UTC (now's, when None; one offset for all dates keeps this
    cheap for thousands of rows, at the cost of an hour's error across a DST change)."""
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return "Older"
    if then.tzinfo is not None:
        then = then.replace(tzinfo=None) - (then.utcoffset() or timedelta())
    if offset is None:
        offset = local_offset()
    day = (then + offset).date()
    today = today or (datetime.now(UTC).replace(tzinfo=None) + offset).date()
    if day >= today:
        return "Today"
    if day == today - timedelta(days=1):
        return "Yesterday"
    if day > today - timedelta(days=7):
        return "Previous 7 days"
    return f"{day:%B %Y}"


def local_offset() -> timedelta:
    """The local time's offset from UTC now."""
    return datetime.now().astimezone().utcoffset() or timedelta()
