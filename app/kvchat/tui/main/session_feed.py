"""What the sessions sidebar shows, read from the store a page at a time, then only what
changed.

At start the first page (the most recently updated sessions) is read and drawn; the
other pages follow in the background, one store read each. From then on a look reads
only what changed since the last one (one indexed query on the list's change stamp, which
any process that makes, changes or deletes a session moves), and where the KV is for the
few sessions whose KV can have moved without their row changing: the open one and those
shown hot or in RAM. So a look costs the same with ten sessions or ten thousand, and the
watch's poll (:meth:`SessionFeed.poll`) is one row read while nothing changes.

Before the service is open (the first paint does not wait for llama.cpp), the first page
is read through the store-only index: each row then says disk or none, as the list says,
and the first look through the service adds where the KV is (only changed rows redraw).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvchat.tui.main.context import ScreenContext
from kvchat.tui.session_rows import SessionRow, with_context

if TYPE_CHECKING:
    from kvchat.service.chat import ChatService, SessionChanges, SessionPage, SessionSummary
    from kvchat.service.session_index import SessionReads

# Sessions read per store call (the first page is all a first paint waits for).
PAGE = 200
# Past MANY sessions, the pages read in the background are shown every SHOW_EVERY pages.
MANY = 2000
SHOW_EVERY = 10
# Where a session's KV lives, and the tokens its snapshot holds.
KvNow = tuple[str, int]


def _first_page(
    reader: SessionReads, service: ChatService | None, ids: list[str]
) -> tuple[int, SessionPage, dict[str, KvNow]]:
    """On the store thread: the stamp (read first: a change during the read shows in the
    next look), the first page, and where the KV is for ``ids`` (once the service is open)."""
    stamp = reader.change_stamp()
    page = reader.list_sessions_page(PAGE)
    return stamp, page, _kv_now(service, ids) if service is not None else {}


def _look(
    service: ChatService, stamp: int, ids: list[str]
) -> tuple[SessionChanges, dict[str, KvNow]]:
    """On the store thread: what changed since ``stamp``; where the KV is for ``ids``."""
    return service.sessions.sessions_changed_since(stamp), _kv_now(service, ids)


def _kv_now(service: ChatService, ids: list[str]) -> dict[str, KvNow]:
    out: dict[str, KvNow] = {}
    for session_id in ids:
        snapshot = service.host.tiers.snapshot(session_id)
        out[session_id] = (service.kv_location(session_id), snapshot.n_tokens if snapshot else 0)
    return out


class SessionFeed:
    """Reads the session list for the sidebar and shows it (see the module docstring)."""

    def __init__(self, ctx: ScreenContext) -> None:
        self.ctx = ctx
        self._by_id: dict[str, SessionSummary] = {}
        self._order: list[str] = []  # most recently updated first
        self._kv: dict[str, str] = {}  # where each session's KV is, as last known
        self._rows: dict[str, SessionRow] = {}  # the rows last shown, by session
        self._deleted: set[str] = set()
        self._stamp: int | None = None  # the change stamp of the last look
        self._next: tuple[str, int] | None = None  # the cursor of the next page to read
        self.complete = False  # every page read
        # Sessions seen changed since the watch last asked (see take_touched).
        self._touched: set[str] = set()

    @property
    def count(self) -> int:
        """Sessions known so far."""
        return len(self._order)

    def _tracked(self) -> list[str]:
        """Sessions whose KV may have moved without their row changing."""
        state = self.ctx.state
        ids = {i for i, kv in self._kv.items() if kv in ("hot", "ram")}
        ids |= {i for i in (state.session_id, state.hot_id) if i is not None}
        return sorted(ids)

    async def refresh(self) -> None:
        """Read what changed since the last look (the first page, the first time) and show
        it. Nothing is applied until every read is back, so a cancelled refresh loses
        nothing: the next one reads from the same stamp."""
        backend = self.ctx.backend
        if self._stamp is not None and backend.service is None:
            return  # the first page is shown; the next look goes through the service
        if self._stamp is None:
            stamp, page, kv = await backend.on_store(
                _first_page, backend.reader, backend.service, self._tracked()
            )
            self._add_page(page)
            self._stamp = stamp
        else:
            service = backend.chat
            changes, kv = await backend.on_store(_look, service, self._stamp, self._tracked())
            self._apply(changes)
        self._apply_kv(kv)
        await self.show()

    async def load_rest(self) -> None:
        """Read the pages after the first, one store call each, showing each as it comes;
        once the start-up has drawn the open session (at thousands of sessions, laying out
        the rows read so far delayed that first frame)."""
        await self.ctx.state.painted.wait()
        backend = self.ctx.backend
        pages = 0
        while not self.complete and self._next is not None:
            page = await backend.on_store(backend.reader.list_sessions_page, PAGE, self._next)
            self._add_page(page)
            pages += 1
            # Each show lays out every row (plain data, no drawing): at thousands of rows,
            # every SHOW_EVERY pages and at the end, not at every page.
            if self.complete or len(self._order) < MANY or pages % SHOW_EVERY == 0:
                await self.show()

    async def poll(self) -> bool:
        """One row read: whether the list changed since the last look (then look)."""
        if self._stamp is None or self.ctx.backend.service is None:
            return False
        backend = self.ctx.backend
        stamp = await backend.on_store(backend.chat.reader.change_stamp)
        if stamp == self._stamp:
            return False
        await self.refresh()
        return True

    def take_touched(self, session_id: str | None) -> bool:
        """Whether ``session_id`` changed since the last call (by any process); forgets the
        changes seen so far."""
        touched = session_id in self._touched
        self._touched.clear()
        return touched

    async def show(self) -> None:
        """Hand the rows to the sidebar (it redraws the rows that changed, only)."""
        state = self.ctx.state
        rows = [self._row(i) for i in self._order]
        rows = with_context(rows, state.open_and_hot, self.ctx.status.used)
        await self.ctx.sessions.show(rows, state.session_id)

    def _row(self, session_id: str) -> SessionRow:
        """The session's row, the same object while its summary and KV place are (so the
        sidebar tells the rows that changed by identity, at any size)."""
        summary, kv = self._by_id[session_id], self._kv.get(session_id, "none")
        row = self._rows.get(session_id)
        if row is None or row.summary is not summary or row.kv != kv:
            row = self._rows[session_id] = SessionRow(summary, kv)
        return row

    # --- applying what was read ---------------------------------------------------------------

    def _add_page(self, page: SessionPage) -> None:
        for summary in page.sessions:
            session_id = summary.session.id
            if session_id in self._by_id or session_id in self._deleted:
                continue  # a look since knows better
            self._by_id[session_id] = summary
            self._order.append(session_id)
            self._kv.setdefault(session_id, "disk" if summary.snapshot_bytes else "none")
        self._next = page.next
        self.complete = page.next is None

    def _apply(self, changes: SessionChanges) -> None:
        self._stamp = changes.stamp
        for session_id in changes.deleted:
            self._deleted.add(session_id)
            if self._by_id.pop(session_id, None) is not None:
                self._order.remove(session_id)
            self._kv.pop(session_id, None)
            self._rows.pop(session_id, None)
        for summary in changes.changed:
            session_id = summary.session.id
            self._touched.add(session_id)
            self._deleted.discard(session_id)
            if session_id not in self._by_id:
                self._order.append(session_id)
            self._by_id[session_id] = summary
            if self._kv.get(session_id) not in ("hot", "ram"):
                self._kv[session_id] = "disk" if summary.snapshot_bytes else "none"
        if changes.changed:
            by_id = self._by_id
            # Stable: sessions updated at the same time keep the store's order.
            self._order.sort(key=lambda i: by_id[i].session.updated, reverse=True)

    def _apply_kv(self, kv: dict[str, KvNow]) -> None:
        for session_id, (where, snapshot_tokens) in kv.items():
            summary = self._by_id.get(session_id)
            if summary is None:
                continue
            self._kv[session_id] = where
            if summary.snapshot_tokens != snapshot_tokens:
                self._by_id[session_id] = replace(summary, snapshot_tokens=snapshot_tokens)
