"""The conversation: one focusable MessageView (role line + Markdown) per message.

Textual's Markdown widget (and the parser and syntax highlighter behind it) is imported
on first use, not with the app: the first frame needs none of it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message as TextualMessage
from textual.widget import Widget
from textual.widgets import Label

from kvchat.text import visible

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.rules_core import StateCore
    from textual.widgets import Markdown
    from textual.widgets._markdown import MarkdownStream

    from kvchat.service.chat import Message

# Markdown that shows text as written: no raw HTML (``<script>``, ``Vec<String>`` are text)
# and no character references (``&amp;`` stays as typed); formatting still renders.
PLAIN_TEXT_RULES = ("html_inline", "html_block", "entity")


def message_parser() -> MarkdownIt:
    """The Markdown parser of every message (Textual's default, less the rules above)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("gfm-like").disable(PLAIN_TEXT_RULES)


def user_parser() -> MarkdownIt:
    """The parser of your own messages: :func:`message_parser`, and every line break you
    typed is kept (each soft break becomes a hard one, so lists, headings and tables that
    follow a line still render, and no backslash is added to the text)."""
    parser = message_parser()
    parser.core.ruler.push("typed_line_breaks", _typed_line_breaks)
    return parser


def _typed_line_breaks(state: StateCore) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type, child.tag = "hardbreak", "br"


def markdown_widget() -> type[Markdown]:
    """Textual's Markdown widget class, imported on first use (see the module docstring)."""
    from textual.widgets import Markdown

    return Markdown


def body_widget() -> type[Markdown]:
    """A message's Markdown widget class (built as composed), imported on first use."""
    from kvchat.tui.widgets.body import MessageBody

    return MessageBody


ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
# Messages mounted when a session opens: Markdown widgets cost a few ms each to build.
SHOWN = 60
# Opening a session mounts first only the latest messages that fill the screen (at least
# this many), then the rest of the SHOWN above them, this many at a time (see fill()).
FIRST_AT_LEAST = 2
FILL_BATCH = 4
# A jump to a message shows this many before it and fills the rest of a window after it,
# so that it costs the same in a session of any length.
BEFORE_HIT = 2
HIT_WINDOW = 12

# A message of yours longer than this many lines (a long paste) shows folded to its first
# FOLD_LINES; Enter on it (or a click on the note) shows it all.
FOLD_LINES = 20
FOLD_AFTER = 24

WELCOME = """\
# Welcome to kvchat

Type a message below and press **Enter** to send it (**Ctrl+J** for a new line).

kvchat keeps each conversation's memory (its KV cache) on disk, so going back to a
session — even after a restart — does not make the model read it all again.
The status bar shows where that memory came from on every turn.

**F1** lists every key · **Ctrl+P** finds any action by name.
"""


class MessageView(Vertical, can_focus=True):
    """One message, headed by its role and its number in the session (``#3``: what
    ``kvchat fork --at`` takes). Focus it (click, or Tab then ↑/↓) to copy it with ``c``
    or a code block with ``b``, see its details with ``i``, branch a new session from it
    with ``f``, or edit it (your messages) with ``e``."""

    BINDINGS = [
        Binding("c", "copy", "Copy message", show=False),
        Binding("b", "copy_code", "Copy code block", show=False),
        Binding("i", "details", "Message details", show=False),
        Binding("f", "branch", "Branch from here", show=False),
        Binding("e", "edit", "Edit message", show=False),
        Binding("up", "move(-1)", "Previous message", show=False),
        Binding("down", "move(1)", "Next message", show=False),
        Binding("left", "version(-1)", "Previous version of the reply", show=False),
        Binding("right", "version(1)", "Next version of the reply", show=False),
        Binding("enter", "toggle_fold", "Show all / fold a long message", show=False),
    ]
    OWN_KEYS = frozenset({"c", "b", "i", "f", "e"})

    @dataclass
    class CopyRequested(TextualMessage):
        view: MessageView
        code: bool

    @dataclass
    class BranchRequested(TextualMessage):
        """``f``: a new session with the messages up to this one."""

        view: MessageView

    @dataclass
    class EditRequested(TextualMessage):
        """``e``: edit this message as a new branch."""

        view: MessageView

    @dataclass
    class VersionRequested(TextualMessage):
        """←/→ on a reply: show its previous (-1) or next (+1) version."""

        view: MessageView
        step: int

    @dataclass
    class DetailsRequested(TextualMessage):
        """``i``: show this message's time and its turn's figures."""

        view: MessageView

    @dataclass
    class TypedAhead(TextualMessage):
        """A printable key that is not one of this widget's keys: it belongs in the input."""

        character: str

    def __init__(
        self,
        role: str,
        text: str = "",
        *,
        message_id: int | None = None,
        partial: bool = False,
        streaming: bool = False,
        number: int | None = None,
        pending: bool = False,
        finish_reason: str | None = None,
    ) -> None:
        classes = f"message -{role}" + (" -partial" if partial else "")
        super().__init__(classes=classes + (" -pending" if pending else ""))
        self.role = role
        self.text = text
        self.message_id = message_id
        self.partial = partial
        self.streaming = streaming
        self.number = number  # 1-based position in the session's messages
        self.stream: MarkdownStream | None = None
        # Why the reply ended, as stored ("length": stopped at the token limit).
        self.finish_reason = finish_reason
        self.cut = False  # the session's last reply, stopped at the token limit: F12 goes on
        self.version = (1, 1)  # a reply's version shown, of how many (←/→ switch)
        # Your message as Enter sent it, before it is stored (it left the input at once).
        self.pending = pending
        # A long message of yours shows its first FOLD_LINES lines until unfolded.
        self.folded = self.foldable

    @classmethod
    def from_message(cls, message: Message, number: int | None = None) -> MessageView:
        return cls(
            message.role,
            message.content,
            message_id=message.id,
            partial=message.partial,
            number=number,
            finish_reason=message.finish_reason,
        )

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-role", markup=False)
        parser = user_parser if self.role == "user" else message_parser
        yield body_widget()(self._shown(self.text), classes="message-body", parser_factory=parser)
        if self.foldable:
            yield Label(self._fold_note(), classes="fold-note", markup=False)

    @property
    def foldable(self) -> bool:
        """A message of yours long enough to fold (a long paste)."""
        return self.role == "user" and self.text.count("\n") >= FOLD_AFTER

    def _shown(self, text: str) -> str:
        """The Markdown source shown for ``text``: as written, without control codes (the
        first FOLD_LINES lines while folded)."""
        text = visible(text)
        if self.folded:
            text = "\n".join(text.split("\n")[:FOLD_LINES])
        return text

    def _fold_note(self) -> str:
        if self.folded:
            more = self.text.count("\n") + 1 - FOLD_LINES
            return f"⋯ {more:,} more lines · Enter shows them all"
        return "Enter folds this message again"

    async def action_toggle_fold(self) -> None:
        """Enter on a long message of yours: show all of it, or fold it again."""
        if not self.foldable:
            return
        self.folded = not self.folded
        await self.body.update(self._shown(self.text))
        for note in self.query(".fold-note").results(Label):
            note.update(self._fold_note())

    async def on_click(self, event: events.Click) -> None:
        widget = event.widget
        if widget is not None and widget.has_class("fold-note"):
            await self.action_toggle_fold()

    def _header(self) -> str:
        name = ROLE_NAMES.get(self.role, self.role)
        if self.number is not None:
            name = f"{name} · #{self.number}"
        if self.version[1] > 1:
            name = f"{name} · reply {self.version[0]}/{self.version[1]} (←/→)"
        if self.pending:
            return f"{name} · sending…"
        if self.streaming:
            return f"{name} ▍"
        if self.partial:
            return f"{name} · partial (stopped)"
        if self.cut:
            return f"{name} · stopped at the token limit (F12 continues)"
        if self.finish_reason == "length":
            return f"{name} · stopped at the token limit"
        return name

    def _show_header(self) -> None:
        for label in self.query(".message-role").results(Label):
            label.update(self._header())

    def set_version(self, position: int, count: int) -> None:
        """Show which version of the reply this is, of how many."""
        if (position, count) != self.version:
            self.version = (position, count)
            self._show_header()

    async def show_version(self, message: Message, position: int, count: int) -> None:
        """Show another version of this reply in place."""
        self.message_id = message.id
        self.partial = message.partial
        self.text = message.content
        self.finish_reason = message.finish_reason
        self.cut = message.finish_reason == "length"  # only the last reply has versions
        self.version = (position, count)
        await self.body.update(self._shown(self.text))
        self.set_class(self.partial, "-partial")
        self._show_header()

    def set_stored(self, message_id: int) -> None:
        """Your pending message is stored (committed): show it as any other message."""
        self.message_id = message_id
        self.pending = False
        self.remove_class("-pending")
        self._show_header()

    def set_cut(self, cut: bool) -> None:
        """Mark (or unmark) the reply as stopped at the token limit, in its header."""
        if cut != self.cut:
            self.cut = cut
            self._show_header()

    @property
    def body(self) -> Markdown:
        return self.query_one(".message-body", markdown_widget())

    def start_stream(self) -> MarkdownStream:
        self.streaming = True
        self._show_header()  # a continued reply shows it is streaming again
        self.stream = markdown_widget().get_stream(self.body)
        return self.stream

    async def write(self, text: str) -> None:
        """Append a buffered chunk of the reply being streamed."""
        self.text += text
        if self.stream is not None:
            await self.stream.write(visible(text))

    async def finish(
        self,
        *,
        text: str,
        message_id: int | None,
        partial: bool,
        finish_reason: str | None = None,
    ) -> None:
        """End the stream; ``text`` is the reply as the service committed it (and
        ``finish_reason`` why it ended; None keeps what was known)."""
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
        self.streaming = False
        self.message_id = message_id
        self.partial = partial
        if finish_reason is not None:
            self.finish_reason = finish_reason
        self.text = text
        shown = self._shown(text)
        if self.body.source != shown:  # e.g. a chunk raced the end of the stream
            await self.body.update(shown)
        self.set_class(partial, "-partial")
        self._show_header()

    def on_key(self, event: events.Key) -> None:
        if event.is_printable and event.character and event.key not in self.OWN_KEYS:
            event.stop()
            event.prevent_default()
            self.post_message(self.TypedAhead(event.character))

    @property
    def conversation(self) -> Conversation | None:
        """The conversation showing this message (its page's parent), if any."""
        page = self.parent
        owner = page.parent if page is not None else None
        return owner if isinstance(owner, Conversation) else None

    def on_focus(self) -> None:
        conversation = self.conversation
        if conversation is not None:
            conversation.cursor = self

    def action_move(self, step: int) -> None:
        conversation = self.conversation
        if conversation is not None:
            conversation.move(self, step)

    def action_version(self, step: int) -> None:
        if self.role == "assistant":
            self.post_message(self.VersionRequested(self, step))

    def action_details(self) -> None:
        self.post_message(self.DetailsRequested(self))

    def action_copy(self) -> None:
        self.post_message(self.CopyRequested(self, code=False))

    def action_copy_code(self) -> None:
        self.post_message(self.CopyRequested(self, code=True))

    def action_branch(self) -> None:
        self.post_message(self.BranchRequested(self))

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


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

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.first = 0  # messages of the session before the first one shown
        self.later = 0  # messages of the session after the last one shown
        self.cursor: MessageView | None = None
        # Shown but not mounted yet (lazy show): mounted above the others by fill().
        self.pending: list[MessageView] = []
        self._shows = 0  # counts show() calls: a fill stops when another show begins
        self._page: ConversationPage | None = None

    async def show(
        self, messages: list[Message], around: int | None = None, *, lazy: bool = False
    ) -> None:
        """Show the last ``SHOWN`` messages, or a window around the message id ``around``.

        ``lazy`` (the latest messages only): mount now just those that fill the screen, and
        keep the others in :attr:`pending` for :meth:`fill`, so that a session is drawn in
        the time a few messages take to build, whatever its length.
        """
        self._shows += 1
        index = next((i for i, m in enumerate(messages) if m.id == around), None)
        if index is not None:
            start = max(0, index - BEFORE_HIT)
            end = min(len(messages), start + HIT_WINDOW)
        else:
            start, end = max(0, len(messages) - SHOWN), len(messages)
        self.first, self.later, self.cursor = start, len(messages) - end, None
        views = [
            MessageView.from_message(m, start + k + 1) for k, m in enumerate(messages[start:end])
        ]
        if views and not self.later and views[-1].finish_reason == "length":
            views[-1].cut = True  # the session's last reply: F12 continues it
        now = self._left_for_later(views) if lazy and index is None else 0
        self.pending = views[:now]
        widgets: list[Widget] = []
        if start:
            plural = "s" if start != 1 else ""
            note = f"{start:,} earlier message{plural} not shown (Ctrl+S exports them all)"
            widgets.append(Label(note, id="earlier", classes="not-shown", markup=False))
        widgets += views[now:]
        if self.later:
            plural = "s" if self.later != 1 else ""
            note = f"{self.later:,} later message{plural} not shown (↓ on the last one shows the latest)"
            widgets.append(Label(note, id="later", classes="not-shown", markup=False))
        if not messages:
            widgets.append(markdown_widget()(WELCOME, id="welcome"))
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

    @property
    def page(self) -> ConversationPage | None:
        """The page of messages shown now (None before the first :meth:`show`)."""
        return self._page

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
        """Mount the views a lazy :meth:`show` left pending, above the others, a few at a
        time with a pause between (so keys and frames get through); the nearest first. Stops
        when another show begins."""
        shows = self._shows
        while self.pending and shows == self._shows:
            batch = self.pending[-FILL_BATCH:]
            del self.pending[-FILL_BATCH:]
            page = self._page
            first = self.views[0] if self.views else None
            if page is None or first is None:
                self.pending = []
                return
            await page.mount_all(batch, before=first)
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
