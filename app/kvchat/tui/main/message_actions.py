"""The main screen's message actions: copy a message or a code block, show a message's details.

Copies go out by OSC 52 and, where tmux would
drop that, by a clipboard command or a file (see :mod:`kvchat.tui.clipboard`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvchat.tui.clipboard import CopyOutcome, choose_route, deliver
from kvchat.tui.main.context import COPY, ScreenContext
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.phrases import FINISH_PHRASES, code_blocks, local_time, turn_lines
from kvchat.tui.widgets.conversation import ROLE_NAMES, MessageView
from kvchat.tui.widgets.message_view import STREAMING

if TYPE_CHECKING:
    from kvchat.service.chat import Message
    from kvchat.service.reports import MessageFigures
    from kvchat.tui.backend import Backend


class MessageActions:
    """Copy (Ctrl+O, F5) and details (F3); the dialogs are awaited in a
    worker of the screen; the copy beyond OSC 52 runs in a worker of the screen too (started
    through the context, so its failures are reported like any other)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener

    def _selected_view(self) -> MessageView | None:
        """The focused message, else the last reply, else the last message."""
        focused = self.ctx.conversation.focused_view
        if focused is not None:
            return focused
        views = self.ctx.conversation.views
        replies = [v for v in views if v.role == "assistant" and not v.streaming]
        return replies[-1] if replies else (views[-1] if views else None)

    # --- copy -----------------------------------------------------------------------------

    def copy_message(self) -> None:
        view = self._selected_view()
        if view is None or not view.text:
            self.ctx.app.notify("No message to copy", severity="warning")
            return
        self.copy(view.text, "message")

    async def copy_code(self, view: MessageView | None = None) -> None:
        """F5: a code block of the selected message, else of any message of the session:
        read from the store, so blocks of messages not shown (or not yet drawn) are
        offered too."""
        focused = view or self.ctx.conversation.focused_view
        if focused is not None:
            sources = [(focused.number, focused.text)]
        else:
            sources = await self._session_texts()
        found = [(b, number) for number, text in sources for b in code_blocks(text)]
        blocks = [b for b, _ in found]
        if not blocks:
            self.ctx.app.notify("No code block to copy", severity="warning")
            return
        if len(blocks) == 1:
            self.copy(blocks[0], "code block")
            return
        from kvchat.tui.screens.dialogs import CodePickerDialog

        where = [f"#{n}" if n is not None and len(sources) > 1 else "" for _, n in found]
        picked = await self.ctx.app.push_screen_wait(CodePickerDialog(blocks, where))
        if picked is not None:
            self.copy(picked, "code block")

    async def _session_texts(self) -> list[tuple[int | None, str]]:
        """Every message of the open session as stored, numbered as in the conversation,
        and a reply still streaming (not stored whole yet) as shown."""
        session_id = self.ctx.state.session_id
        if session_id is None:
            return []
        backend = self.ctx.backend
        reader = backend.reader
        first = await backend.on_store(reader.message_window, session_id, 1, from_start=True)
        # The row's count may lag a message another process just added: a margin.
        window = await backend.on_store(
            reader.message_window, session_id, first.total + 64, from_start=True
        )
        streaming = [v for v in self.ctx.conversation.views if v.streaming or v.pending]
        texts: list[tuple[int | None, str]] = [
            (number, m.content)
            for number, m in enumerate(window.messages, 1)
            if not (streaming and m.partial and m.finish_reason == STREAMING)
        ]
        return texts + [(v.number, v.text) for v in streaming]

    async def copy_conversation(self) -> None:
        """Shift+F5: the whole open session as Markdown (its export), from the store."""
        session_id = self.ctx.state.session_id
        if session_id is None:
            self.ctx.app.notify("No conversation to copy yet", severity="warning")
            return
        text: str = await self.ctx.backend.on_store(
            self.ctx.backend.chat.sessions.export, session_id, "md"
        )
        self.copy(text, "conversation")

    def copy(self, text: str, what: str) -> None:
        # OSC 52 always (the terminal's clipboard, and the app's own for pasting in it);
        # the rest runs off the UI thread: it may ask tmux and run a clipboard command.
        self.ctx.app.copy_to_clipboard(text)
        self.ctx.run(COPY, self.copy_elsewhere, text, what)

    async def copy_elsewhere(self, text: str, what: str) -> CopyOutcome:
        """By a clipboard command or a file where tmux drops OSC 52; says where it went."""
        outcome = await asyncio.to_thread(_route_and_deliver, text)
        lines = text.count("\n") + 1
        copied = f"Copied the {what} ({lines:,} line{'s' if lines != 1 else ''})"
        if outcome.how == "terminal":
            self.ctx.app.notify(copied)
        elif outcome.how == "command":
            self.ctx.app.notify(f"{copied} {outcome.note}", markup=False, timeout=8)
        else:
            self.ctx.app.notify(
                f"{copied} {outcome.note}", severity="warning", markup=False, timeout=15
            )
        return outcome

    # --- details --------------------------------------------------------------------------

    async def _figure_lines(self, stored: Message) -> list[str]:
        """A reply's figures: this run's turn report (with what was saved), else those kept
        with it in the database (after a restart), with the model that wrote it."""
        from kvchat.service.reports import figure_lines

        kept = await _figures(self.ctx.backend, stored.id)
        report = self.ctx.state.turn_figures.get(stored.id)
        if report is not None:
            return ([f"Model: {kept.model}"] if kept is not None and kept.model else []) + (
                turn_lines(report)
            )
        if kept is None:
            return ["Figures: none kept (a reply imported, or stored before kvchat kept them)"]
        ended = FINISH_PHRASES.get(stored.finish_reason or "", stored.finish_reason)
        return figure_lines(kept) + ([f"Ended: {ended}"] if ended else [])

    async def details(self, view: MessageView | None = None) -> None:
        """F3: time, tokens and, for a reply of this run, its turn's figures."""
        view = view or self._selected_view()
        if view is None or self.ctx.state.session_id is None:
            self.ctx.app.notify("No message to show", severity="warning")
            return
        name = ROLE_NAMES.get(view.role, view.role)
        number = f" #{view.number}" if view.number is not None else ""
        title = f"Message{number} · {name}"
        message_id = await self.opener.stored_id(view)
        stored: Message | None = None
        if message_id is not None:
            messages = await self.ctx.backend.on_store(
                self.ctx.backend.chat.sessions.messages, self.ctx.state.session_id
            )
            stored = next((m for m in messages if m.id == message_id), None)
        lines: list[str] = []
        if stored is None:
            lines.append("Not saved yet: the reply is still being generated")
        else:
            lines.append(f"Time: {local_time(stored.created)}")
            lines.append(f"Tokens: {stored.token_count:,}")
            if stored.partial:
                lines.append("Partial: the reply was stopped before its end")
        if view.role == "assistant" and stored is not None:
            lines += await self._figure_lines(stored)
        from kvchat.tui.screens.details import DetailsDialog

        await self.ctx.app.push_screen_wait(DetailsDialog(title, lines))


async def _figures(backend: Backend, message_id: int) -> MessageFigures | None:
    kept: MessageFigures | None = await backend.on_store(backend.chat.sessions.figures, message_id)
    return kept


def _route_and_deliver(text: str) -> CopyOutcome:
    """On a worker thread: find how to copy here and do it."""
    from kvchat.paths import data_dir

    return deliver(choose_route(), text, data_dir())
