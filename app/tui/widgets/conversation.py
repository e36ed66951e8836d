"""The conversation: one focusable MessageView (role line + Markdown) per message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message as TextualMessage
from textual.widgets import Label, Markdown
from textual.widgets._markdown import MarkdownStream

from kvchat.tui.format import hard_breaks, visible

if TYPE_CHECKING:
    from kvchat.chat import Message

# Markdown that shows text as written: no raw HTML (``<script>``, ``Vec<String>`` are text)
# and no character references (``&amp;`` stays as typed); formatting still renders.
PLAIN_TEXT_RULES = ("html_inline", "html_block", "entity")


def message_parser() -> MarkdownIt:
    """The Markdown parser of every message (Textual's default, less the rules above)."""
    return MarkdownIt("gfm-like").disable(PLAIN_TEXT_RULES)


ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
# Messages mounted when a session opens: Markdown widgets cost a few ms each to build.
SHOWN = 60

WELCOME = """\
# Welcome to kvchat

Type a message below and press **Enter** to send it (**Ctrl+J** for a new line).

kvchat keeps each conversation's memory (its KV cache) on disk, so going back to a
session — even after a restart — does not make the model read it all again.
The status bar shows where that memory came from on every turn.

**F1** lists every key · **Ctrl+P** finds any action by name.
"""


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (click or Tab) to copy it with ``c`` or a code block with ``b``,
    branch a new session from it with ``f``, or edit it (your messages) with ``e``."""

    BINDINGS = [
        Binding("c", "copy", "Copy message", show=False),
        Binding("b", "copy_code", "Copy code block", show=False),
        Binding("f", "branch", "Branch from here", show=False),
        Binding("e", "edit", "Edit message", show=False),
    ]
    OWN_KEYS = frozenset({"c", "b", "f", "e"})

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
    ) -> None:
        super().__init__(classes=f"message -{role}" + (" -partial" if partial else ""))
        self.role = role
        self.text = text
        self.message_id = message_id
        self.partial = partial
        self.streaming = streaming
        self.stream: MarkdownStream | None = None

    @classmethod
    def from_message(cls, message: Message) -> MessageView:
        return cls(message.role, message.content, message_id=message.id, partial=message.partial)

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-role", markup=False)
        yield Markdown(
            self._shown(self.text), classes="message-body", parser_factory=message_parser
        )

    def _shown(self, text: str) -> str:
        """The Markdown source shown for ``text``: your line breaks kept, no control codes."""
        text = visible(text)
        return hard_breaks(text) if self.role == "user" else text

    def _header(self) -> str:
        name = ROLE_NAMES.get(self.role, self.role)
        if self.streaming:
            return f"{name} ▍"
        if self.partial:
            return f"{name} · partial (stopped)"
        return name

    @property
    def body(self) -> Markdown:
        return self.query_one(".message-body", Markdown)

    def start_stream(self) -> MarkdownStream:
        self.streaming = True
        self.stream = Markdown.get_stream(self.body)
        return self.stream

    async def write(self, text: str) -> None:
        """Append a buffered chunk of the reply being streamed."""
        self.text += text
        if self.stream is not None:
            await self.stream.write(visible(text))

    async def finish(self, *, text: str, message_id: int | None, partial: bool) -> None:
        """End the stream; ``text`` is the reply as the service committed it."""
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
        self.streaming = False
        self.message_id = message_id
        self.partial = partial
        self.text = text
        shown = self._shown(text)
        if self.body.source != shown:  # e.g. a chunk raced the end of the stream
            await self.body.update(shown)
        self.set_class(partial, "-partial")
        self.query_one(".message-role", Label).update(self._header())

    def on_key(self, event: events.Key) -> None:
        if event.is_printable and event.character and event.key not in self.OWN_KEYS:
            event.stop()
            event.prevent_default()
            self.post_message(self.TypedAhead(event.character))

    def action_copy(self) -> None:
        self.post_message(self.CopyRequested(self, code=False))

    def action_copy_code(self) -> None:
        self.post_message(self.CopyRequested(self, code=True))

    def action_branch(self) -> None:
        self.post_message(self.BranchRequested(self))

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


class Conversation(VerticalScroll):
    """The messages of the open session; stays scrolled to the end while a reply streams."""

    async def show(self, messages: list[Message], include: int | None = None) -> None:
        """Show the last ``SHOWN`` messages (from message ``include`` on, if it is older)."""
        await self.remove_children()
        start = max(0, len(messages) - SHOWN)
        if include is not None:
            start = min(start, next((i for i, m in enumerate(messages) if m.id == include), start))
        if start:
            plural = "s" if start != 1 else ""
            note = f"{start} earlier message{plural} not shown (Ctrl+S exports them all)"
            await self.mount(Label(note, id="earlier", markup=False))
        if messages:
            await self.mount_all(MessageView.from_message(m) for m in messages[start:])
        else:
            await self.mount(Markdown(WELCOME, id="welcome"))
        self.anchor()

    async def add(self, view: MessageView) -> MessageView:
        for welcome in self.query("#welcome"):
            await welcome.remove()
        await self.mount(view)
        self.anchor()
        return view

    @property
    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def find(self, message_id: int) -> MessageView | None:
        return next((v for v in self.views if v.message_id == message_id), None)
