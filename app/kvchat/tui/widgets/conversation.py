"""The conversation: a window of the session's messages, one MessageView each.

A session of any length opens on its latest messages; scrolling up past the first one
shown (the mouse, PgUp, ↑) mounts the page before it, keeping the place on screen, and
Home goes to the very first message; the newest views are let go meanwhile, so a window
of at most ``MAX_VIEWS`` messages is mounted, whatever the session's length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from textual import events, on
from textual.containers import Vertical, VerticalScroll
from textual.message import Message as TextualMessage
from textual.widget import Widget
from textual.widgets import Label
from textual.worker import Worker, WorkerState

from kvchat.text import visible
from kvchat.tui.widgets.body import MessageBody
from kvchat.tui.widgets.message_view import ROLE_NAMES, MessageView, message_parser
from kvchat.tui.widgets.thought import ThoughtFigures

if TYPE_CHECKING:
    from kvchat.service.chat import Message

__all__ = ["ROLE_NAMES", "Conversation", "ConversationPage", "MessagePages", "MessageView"]

# Messages mounted when a session opens (each renders its Markdown when laid out).
SHOWN = 24
# Opening a session mounts first only the latest messages that fill the screen (at least
# this many), then the rest of the SHOWN above them, this many at a time (see fill()).
FIRST_AT_LEAST = 2
FILL_BATCH = 4
# A jump to a message shows this many before it and fills the rest of a window after it,
# so that it costs the same in a session of any length.
BEFORE_HIT = 2
HIT_WINDOW = 12
# Scrolling up to the first message shown (within NEAR_TOP lines of the top) mounts this
# many before it; at most MAX_VIEWS are mounted, the newest let go beyond (they come back
# with ↓ past the last one shown, End, or a new turn, as after a jump).
EARLIER_PAGE = 30
NEAR_TOP = 3
MAX_VIEWS = 150

WELCOME = """\
# Welcome to kvchat

Type a message below and press **Enter** to send it (**Ctrl+J** for a new line).

kvchat keeps each conversation's memory (its KV cache) on disk, so going back to a
session — even after a restart — does not make the model read it all again.
The status bar shows where that memory came from on every turn.

**F1** lists every key · **Ctrl+P** finds any action by name.
"""


class MessagePages(Protocol):
    """Where a long session's messages that are not shown come from, a page at a time (the
    store, read on its thread): the conversation never holds the whole session."""

    async def before(self, message_id: int, limit: int) -> list[Message]:
        """Up to ``limit`` messages just before the message id ``message_id``, in order."""
        ...

    async def opening(self, limit: int) -> tuple[list[Message], int]:
        """The session's first ``limit`` messages, and how many it has."""
        ...


class ConversationPage(Vertical):
    """What a :meth:`Conversation.show` shows: its messages and notes, replaced whole by the
    next show (so the old page can be dropped after the new one is drawn)."""

    DEFAULT_CSS = """
    ConversationPage {
        height: auto;
    }
    """


class Conversation(VerticalScroll, can_focus=False):
    """The messages of the open session; stays scrolled to the end while a reply streams.

    It shows a contiguous run of the session's messages: the latest ``SHOWN``, or a short
    window around a message jumped to (then later messages are left out until ↓ past the
    last one, or a new turn, shows the latest again). The messages are one stop for Tab
    (the one last focused, else the last); ↑/↓ move between them.
    """

    @dataclass
    class LatestRequested(TextualMessage):
        """↓ past the last shown message while later ones are left out."""

    @dataclass
    class LeaveRequested(TextualMessage):
        """↓ past the last message of the session: on to the input."""

    @dataclass
    class PagingFailed(TextualMessage):
        """Mounting a page of messages failed (a bug): the screen reports it."""

        worker: Worker[None]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.first = 0  # messages of the session before the first one shown
        self.later = 0  # messages of the session after the last one shown
        self.cursor: MessageView | None = None
        # Shown but not mounted yet (lazy show): mounted above the others by fill() (below
        # them after Home or a jump).
        self.pending: list[MessageView] = []
        self._shows = 0  # counts show() calls: a fill stops when another show begins
        self._page: ConversationPage | None = None
        # The messages last shown (a window of the session, ``_base`` messages before it)
        # and where the others come from (None: ``_messages`` is the whole session).
        self._messages: list[Message] = []
        self._base = 0
        self.pages: MessagePages | None = None
        self._paging = False  # a page before the first one shown is being mounted
        self._pending_below = False  # the pending views go below the shown ones (Home)
        # How long and how much replies of this run thought, by message id and reasoning
        # (a reply's versions share its id; the store keeps the reasoning, not these):
        # their folded line says it when shown again.
        self.thought_figures: dict[tuple[int, str], ThoughtFigures] = {}
        # Where the model's window starts: the divider's message id and its line (None: the
        # model reads every message), and the summary it reads before it (None: none).
        self.window_start: tuple[int, str] | None = None
        self.window_summary: str | None = None

    async def show(
        self,
        messages: list[Message],
        around: int | None = None,
        *,
        lazy: bool = False,
        from_start: bool = False,
        first: int = 0,
        total: int | None = None,
        pages: MessagePages | None = None,
    ) -> None:
        """Show the last ``SHOWN`` messages, or a window around the message id ``around``,
        or (``from_start``) the first ``SHOWN``.

        ``messages`` is the whole session, or (with ``pages``, where the rest comes from)
        a window of it: ``first`` messages before it, ``total`` in all.

        ``lazy``: mount now just those that fill the screen (after a jump: from the hit
        down), and keep the others in :attr:`pending` for :meth:`fill`, so that a session
        is drawn in the time a few messages take to build, whatever its length.
        """
        self._shows += 1
        self._messages, self._base, self.pages = messages, first, pages
        total = first + len(messages) if total is None else total
        index = next((i for i, m in enumerate(messages) if m.id == around), None)
        if index is not None:
            start = max(0, index - BEFORE_HIT)
            end = min(len(messages), start + HIT_WINDOW)
        elif from_start:
            start, end = 0, min(len(messages), SHOWN)
        else:
            start, end = max(0, len(messages) - SHOWN), len(messages)
        self.first, self.later, self.cursor = first + start, total - first - end, None
        views = [
            MessageView.from_message(
                m, first + start + k + 1, self.thought_figures.get((m.id, m.reasoning))
            )
            for k, m in enumerate(messages[start:end])
        ]
        if views and not self.later and views[-1].finish_reason == "length":
            views[-1].cut = True  # the session's last reply: F12 continues it
        # After Home or a jump the window's top is on screen (a jump scrolls the hit to the
        # top): the rest of it is mounted below; else the latest are, and the rest above.
        self._pending_below = from_start or index is not None
        if lazy and self._pending_below:
            # Those before the hit, and from it (or the first) those that fill the screen
            # now; those after them by fill().
            top = index - start if index is not None else 0
            keep = top + self._screenful(views[top:])
            shown, self.pending = views[:keep], views[keep:]
        else:
            now = self._left_for_later(views) if lazy else 0
            self.pending, shown = views[:now], views[now:]
        widgets: list[Widget] = []
        if self.first:
            widgets.append(
                Label(_earlier_note(self.first), id="earlier", classes="not-shown", markup=False)
            )
        widgets += shown
        if self.later:
            widgets.append(
                Label(_later_note(self.later), id="later", classes="not-shown", markup=False)
            )
        if not total:
            widgets.append(MessageBody(WELCOME, id="welcome", parser_factory=message_parser))
        # One batch: the old messages stay on screen until the new ones are in place. The
        # old page is hidden, and removed only once the new one is drawn (removing some
        # sixty messages' widgets costs about as much as building the few now shown).
        page = ConversationPage(*widgets)
        old, self._page = self._page, page
        with self.app.batch_update():
            if old is not None:
                old.display = False
            await self.mount(page)
            self.anchor()
        if old is not None:
            self.call_after_refresh(old.remove)
        await self.place_divider()

    # --- what the model sees --------------------------------------------------------------

    async def set_window(
        self, message_id: int | None, line: str | None, summary: str | None = None
    ) -> None:
        """Draw the divider above message ``message_id`` (where the model's window starts,
        ``line`` saying so, then the ``summary`` the model reads there), or none; kept
        across shows of the session."""
        self.window_start = (message_id, line) if message_id is not None and line else None
        self.window_summary = summary if self.window_start is not None else None
        await self.place_divider()

    async def place_divider(self) -> None:
        """Put the divider above its message when that message is mounted (again)."""
        page = self._page
        if page is None:
            return
        for old in page.query("#window-divider, #window-summary"):
            await old.remove()
        start = self.window_start
        view = self.find(start[0]) if start is not None else None
        if start is None or view is None or view.parent is not page:
            return
        labels = [
            Label(f"── {start[1]} ──", id="window-divider", classes="not-shown", markup=False)
        ]
        if self.window_summary:
            text = f"Summary the model reads: {visible(self.window_summary)}"
            labels.append(Label(text, id="window-summary", classes="not-shown", markup=False))
        await page.mount(*labels, before=view)  # together: never a divider without its summary

    # --- the pages before and after the window ------------------------------------------------

    def _near_top(self) -> bool:
        return min(self.scroll_y, self.scroll_target_y) <= NEAR_TOP

    def _page_in_earlier(self) -> None:
        """At the top of the window with earlier messages left out: mount the page before."""
        if self.first and not self.pending and not self._paging and self._near_top():
            self._paging = True
            self._run(self._mount_earlier())

    async def _mount_earlier(self, focus_step: MessageView | None = None) -> None:
        """Mount up to EARLIER_PAGE messages above the first shown one, keeping the place on
        screen (the scroll moves down by what was added); then let the newest views go
        beyond MAX_VIEWS. ``focus_step``: the view ↑ was pressed on (the one before it gets
        the focus)."""
        try:
            page, views, shows = self._page, self.views, self._shows
            if page is None or not views or not self.first:
                return
            anchor = views[0]
            earlier = await self._earlier(anchor)
            if shows != self._shows or not earlier:
                return
            start = self.first - len(earlier)
            batch = [
                MessageView.from_message(
                    m, start + k + 1, self.thought_figures.get((m.id, m.reasoning))
                )
                for k, m in enumerate(earlier)
            ]
            before_y = anchor.virtual_region.y
            self.anchor(False)
            await page.mount_all(batch, before=anchor)
            if self.window_start is not None and self.find(self.window_start[0]) in batch:
                await self.place_divider()
            if shows != self._shows:
                return
            self.first = start
            for note in page.query("#earlier").results(Label):
                if start:
                    note.update(_earlier_note(start))
                else:
                    await note.remove()
            await self._let_newest_go()
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def keep_place() -> None:
                added = anchor.virtual_region.y - before_y
                if added > 0:
                    self.scroll_to(y=self.scroll_y + added, animate=False, immediate=True)
                if not done.done():
                    done.set_result(None)

            self.call_after_refresh(keep_place)
            await done
            if focus_step is not None:
                self.move(focus_step, -1)
        finally:
            self._paging = False

    async def _earlier(self, anchor: MessageView) -> list[Message]:
        """Up to EARLIER_PAGE messages before the first shown one (``anchor``): read from
        the store when only a window of the session was given."""
        wanted = min(EARLIER_PAGE, self.first)
        if self.pages is not None and anchor.message_id is not None:
            return await self.pages.before(anchor.message_id, wanted)
        end = self.first - self._base
        return self._messages[max(0, end - wanted) : max(0, end)]

    async def _let_newest_go(self) -> None:
        """Unmount the newest views beyond MAX_VIEWS (none while a reply streams or a
        message is pending): they count as later messages."""
        views, page = self.views, self._page
        extra = len(views) - MAX_VIEWS
        if extra <= 0 or page is None or any(v.streaming or v.pending for v in views):
            return
        gone = views[-extra:]
        self.later += extra
        if self.cursor in gone:
            self.cursor = None
        focused = self.screen.focused
        if isinstance(focused, MessageView) and focused in gone:
            # Scrolled out of sight and let go: the focus (and so the keys) moves to the
            # first message on screen.
            top = self.scroll_y
            kept = views[:-extra]
            shown = next((v for v in kept if v.virtual_region.bottom > top), kept[-1])
            shown.focus(scroll_visible=False)
        await page.remove_children(gone)
        notes = list(page.query("#later").results(Label))
        if notes:
            notes[0].update(_later_note(self.later))
        else:
            await page.mount(
                Label(_later_note(self.later), id="later", classes="not-shown", markup=False)
            )

    async def _show_from_start(self) -> None:
        """Home with earlier messages left out: the first messages, the first focused."""
        pages = self.pages
        if pages is not None:
            messages, total = await pages.opening(SHOWN)
            await self.show(messages, from_start=True, lazy=True, total=total, pages=pages)
        else:
            await self.show(self._messages, from_start=True, lazy=True)
        self.anchor(False)
        self.scroll_home(animate=False, immediate=True)
        views = self.views
        if views:
            views[0].focus(scroll_visible=False)
        await self.fill()

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        self.run_worker(work, group="conversation-pages", exit_on_error=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            self.post_message(self.PagingFailed(event.worker))

    def action_scroll_home(self) -> None:
        if self.first:
            self._run(self._show_from_start())
        else:
            super().action_scroll_home()

    def action_scroll_end(self) -> None:
        if self.later:
            self.post_message(self.LatestRequested())
        else:
            super().action_scroll_end()

    def action_page_up(self) -> None:
        super().action_page_up()
        self._page_in_earlier()

    def action_scroll_up(self) -> None:
        super().action_scroll_up()
        self._page_in_earlier()

    def on_mouse_scroll_up(self, _event: events.MouseScrollUp) -> None:
        self._page_in_earlier()

    @on(MessageView.MoveRequested)
    def _move_requested(self, event: MessageView.MoveRequested) -> None:
        event.stop()
        self.move(event.view, event.step)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        if isinstance(event.widget, MessageView):
            self.cursor = event.widget

    @property
    def page(self) -> ConversationPage | None:
        """The page of messages shown now (None before the first :meth:`show`)."""
        return self._page

    def _screenful(self, views: list[MessageView]) -> int:
        """How many of ``views``, from the first, fill the viewport (by an estimate of their
        height: wrapped lines plus the header and margin); at least FIRST_AT_LEAST."""
        width = max(20, (self.size.width or 80) - 6)
        height = self.size.height or 40
        lines = keep = 0
        for view in views:
            if lines > height and keep >= FIRST_AT_LEAST:
                break
            keep += 1
            lines += 3 + sum(len(line) // width + 1 for line in view.text[:20_000].split("\n"))
        return keep

    def _left_for_later(self, views: list[MessageView]) -> int:
        """How many of ``views`` to leave for later: the last ones that fill the viewport
        (by an estimate of their height: wrapped lines plus the header and margin) stay."""
        width = max(20, (self.size.width or 80) - 6)
        height = self.size.height or 40
        lines = 0
        keep = 0
        for view in reversed(views):
            if lines > height and keep >= FIRST_AT_LEAST:
                break
            keep += 1
            lines += 3 + sum(len(line) // width + 1 for line in view.text.split("\n"))
        return len(views) - keep

    async def fill(self) -> None:
        """Mount the views a lazy :meth:`show` left pending, above the others (below them
        after Home), a few at a time with a pause between (so keys and frames get through);
        the nearest first. Stops when another show begins."""
        shows = self._shows
        while self.pending and shows == self._shows:
            page, views = self._page, self.views
            if page is None or not views:
                self.pending = []
                return
            if self._pending_below:  # Home: the first messages shown, those after follow
                batch = self.pending[:FILL_BATCH]
                del self.pending[:FILL_BATCH]
                await page.mount_all(batch, after=views[-1])
            else:
                batch = self.pending[-FILL_BATCH:]
                del self.pending[-FILL_BATCH:]
                await page.mount_all(batch, before=views[0])
            if self.window_start is not None and self.find(self.window_start[0]) in batch:
                await self.place_divider()
            await asyncio.sleep(0)

    async def add(self, view: MessageView) -> MessageView:
        """Append a message (the caller shows the latest first when later ones are left out)."""
        page = self._page
        for welcome in page.query("#welcome") if page is not None else ():
            await welcome.remove()
        if view.number is None:
            last = self.last_view
            view.number = (last.number or 0) + 1 if last is not None else self.first + 1
        page = self._page
        if page is None:
            page = self._page = ConversationPage()
            await self.mount(page)
        await page.mount(view)
        self.anchor()
        return view

    @property
    def views(self) -> list[MessageView]:
        page = self._page
        children = page.children if page is not None else ()
        return [child for child in children if isinstance(child, MessageView)]

    @property
    def last_view(self) -> MessageView | None:
        page = self._page
        children = page.children if page is not None else ()
        return next((c for c in reversed(children) if isinstance(c, MessageView)), None)

    @property
    def focused_view(self) -> MessageView | None:
        """The message that has focus, if one has."""
        focused = self.screen.focused
        return focused if isinstance(focused, MessageView) else None

    def find(self, message_id: int) -> MessageView | None:
        return next((v for v in self.views if v.message_id == message_id), None)

    def tab_stop(self) -> MessageView | None:
        """The one message in the focus chain: the focused or last focused one, else the last."""
        cursor = self.cursor
        if cursor is not None and cursor.parent is self._page:
            return cursor
        return self.last_view

    def move(self, view: MessageView, step: int) -> None:
        """Focus the message ``step`` places from ``view``, scrolling it into sight."""
        views = self.views
        if view not in views:
            return
        index = views.index(view) + step
        if index < 0 and self.first and not self.pending:
            # ↑ on the first message shown: the page before it, then the one before it.
            if not self._paging:
                self._paging = True
                self._run(self._mount_earlier(view))
            return
        if index < 0:
            self.scroll_home(animate=False)
            return
        if index >= len(views):
            self.post_message(self.LatestRequested() if self.later else self.LeaveRequested())
            return
        target = views[index]
        self.anchor(False)
        target.focus(scroll_visible=False)
        self.scroll_to_widget(target, animate=False, immediate=True)


def _earlier_note(count: int) -> str:
    plural = "s" if count != 1 else ""
    return f"{count:,} earlier message{plural} · scroll up, PgUp or Home shows them"


def _later_note(count: int) -> str:
    plural = "s" if count != 1 else ""
    return f"{count:,} later message{plural} not shown (↓ on the last one shows the latest)"
