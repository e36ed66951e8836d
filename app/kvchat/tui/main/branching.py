"""The main screen's branch actions: branch a new session from a message, edit a past message.

Both create a new session and leave the
original conversation as it was; the new session shares the original's KV prefix, so
switching to it (branch) or generating its reply (edit) restores that prefix instead of
reading it again. Every service call runs on the engine thread: ``edit`` tokenizes and
the reply runs the model; ``fork`` only writes the store but is queued with the rest.
"""

from __future__ import annotations

from kvchat.errors import KvchatError
from kvchat.text import visible
from kvchat.tui.main.context import ScreenContext
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.screen_state import ActiveTurn, idle_or_say
from kvchat.tui.main.signals import OpenRequested, TurnRequested
from kvchat.tui.phrases import shorten
from kvchat.tui.widgets.conversation import MessageView


class Branching:
    """Branch (Ctrl+T) and edit (F4); each runs in a worker of the screen."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener

    async def _branch_point(self, view: MessageView, what: str) -> int | None:
        """The store id of ``view`` if a branch may start there now; else say why not."""
        if not self.ctx.state.ready:
            self.ctx.app.notify(f"Cannot {what} while the model loads", severity="warning")
            return None
        if not idle_or_say(self.ctx.app, self.ctx.state, what):
            return None
        message_id = await self.opener.stored_id(view)
        if message_id is None:
            self.ctx.app.notify(
                "This message is not saved yet: wait for the reply", severity="warning"
            )
        return message_id

    # --- branch ---------------------------------------------------------------------------

    async def branch(self, view: MessageView | None = None) -> None:
        """Ctrl+T: a new session with the messages up to the selected one, opened.

        Without a selected message the branch takes the whole conversation.
        """
        session_id = self.ctx.state.session_id
        if view is None:
            view = self.ctx.conversation.focused_view
            if view is None:
                stored = [v for v in self.ctx.conversation.views if v.message_id is not None]
                view = stored[-1] if stored else None
        if session_id is None or view is None:
            self.ctx.app.notify("No message to branch from yet", severity="warning")
            return
        message_id = await self._branch_point(view, "branch")
        if message_id is None:
            return
        try:
            branch = await self.ctx.backend.on_engine(
                self.ctx.backend.chat.sessions.fork, session_id, at_message=message_id
            )
        except KvchatError as exc:
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        await self.ctx.refresh()
        self.ctx.app.notify(
            f"Branched into “{shorten(branch.title, 40)}”; the original is kept", markup=False
        )
        # The usual switch: shows the messages, then makes the branch hot on the engine
        # thread (the shared prefix comes from the original's snapshot) and says so.
        self.ctx.post(OpenRequested(branch.id, focus_prompt=True))

    # --- edit -----------------------------------------------------------------------------

    async def edit_message(self, view: MessageView | None = None) -> None:
        """F4: edit a past message of yours as a new branch, then regenerate.

        Without a selected message it edits your last one. The original is kept.
        """
        session_id = self.ctx.state.session_id
        if view is None:
            view = self.ctx.conversation.focused_view
            if view is None:
                mine = [v for v in self.ctx.conversation.views if v.role == "user"]
                view = mine[-1] if mine else None
        if session_id is None or view is None:
            self.ctx.app.notify("No message of yours to edit yet", severity="warning")
            return
        if view.role != "user":
            self.ctx.app.notify(
                "Only your own messages can be edited: Ctrl+R regenerates the last reply, "
                "Ctrl+T branches from this one",
                severity="warning",
            )
            return
        message_id = await self._branch_point(view, "edit a message")
        if message_id is None:
            return
        original = visible(view.text)  # what the message shows
        from kvchat.tui.screens.dialogs import EditDialog

        text: str | None = await self.ctx.app.push_screen_wait(EditDialog(original))
        if text is None:
            return
        if text == original.strip():
            self.ctx.app.notify("The message is unchanged: nothing to do")
            return
        if self.ctx.state.session_id != session_id or not idle_or_say(
            self.ctx.app, self.ctx.state, "edit a message"
        ):
            return
        # Hold the turn from now on, so nothing else starts while the branch is made.
        turn = ActiveTurn("regenerate", None, None)
        self.ctx.state.turn = turn
        self.ctx.status.set_turn("branching…", "busy")
        try:
            branch = await self.ctx.backend.on_engine(
                self.ctx.backend.chat.sessions.edit, session_id, message_id, text
            )
        except BaseException as exc:
            self.ctx.state.turn = None
            if not isinstance(exc, KvchatError):
                self.ctx.status.set_turn("")
                raise
            self.ctx.status.set_turn(str(exc), "error")
            self.ctx.app.notify(str(exc), severity="error", markup=False)
            return
        turn.session_id = self.ctx.state.session_id = branch.id
        self.ctx.state.shown_id = None
        await self.opener.show_stored(branch.id, lazy=False)
        await self.ctx.refresh()
        self.ctx.prompt.focus()
        self.ctx.app.notify(
            f"Edited into a new branch “{shorten(branch.title, 40)}”; the original is kept",
            markup=False,
        )
        # Like Ctrl+R: the reply streams in; the engine thread makes the branch hot with
        # the KV prefix it shares with the original.
        self.ctx.post(TurnRequested(turn))
