"""The main screen's branch actions: branch a new session from a message, edit a past message.

A mixin of MainScreen, like SessionActions. Both create a new session and leave the
original conversation as it was; the new session shares the original's KV prefix, so
switching to it (branch) or generating its reply (edit) restores that prefix instead of
reading it again. Every service call runs on the engine thread: ``edit`` tokenizes and
the reply runs the model; ``fork`` only writes the store but is queued with the rest.
"""

from __future__ import annotations

from textual import work

from kvchat.errors import KvchatError
from kvchat.tui.base import ScreenBase
from kvchat.tui.format import shorten, visible
from kvchat.tui.widgets.conversation import MessageView


class BranchActions(ScreenBase):
    async def _stored_id(self, view: MessageView) -> int | None:
        """The store id of a shown message. A message sent in this window has none on its
        view yet: find it in the store, where the shown messages are the newest ones."""
        if view.message_id is not None or view.streaming or self.session_id is None:
            return view.message_id
        views = self.conversation.views
        if view not in views:
            return None
        messages = await self.on_store(self.service.messages, self.session_id)
        back = len(views) - views.index(view)
        if back > len(messages):
            return None
        message = messages[-back]
        if message.role != view.role or message.content != view.text:
            return None
        view.message_id = message.id
        return view.message_id

    async def _branch_point(self, view: MessageView, what: str) -> int | None:
        """The store id of ``view`` if a branch may start there now; else say why not."""
        if not self.ready:
            self.notify(f"Cannot {what} while the model loads", severity="warning")
            return None
        if not self._idle(what):
            return None
        message_id = await self._stored_id(view)
        if message_id is None:
            self.notify("This message is not saved yet: wait for the reply", severity="warning")
        return message_id

    # --- branch ---------------------------------------------------------------------------

    # MainScreen routes ``f`` and ``e`` on a message here (a mixin's @on is not collected).

    @work(group="action", exit_on_error=False)
    async def action_branch(self, view: MessageView | None = None) -> None:
        """Ctrl+T / ``f``: a new session with the messages up to the selected one, opened.

        Without a selected message the branch takes the whole conversation.
        """
        session_id = self.session_id
        if view is None:
            view = self._focused_message()
            if view is None:
                stored = [v for v in self.conversation.views if v.message_id is not None]
                view = stored[-1] if stored else None
        if session_id is None or view is None:
            self.notify("No message to branch from yet", severity="warning")
            return
        message_id = await self._branch_point(view, "branch")
        if message_id is None:
            return
        try:
            branch = await self.on_engine(self.service.fork, session_id, at_message=message_id)
        except KvchatError as exc:
            self.notify(str(exc), severity="error", markup=False)
            return
        await self.refresh_sessions()
        self.notify(
            f"Branched into “{shorten(branch.title, 40)}”; the original is kept", markup=False
        )
        # The usual switch: shows the messages, then makes the branch hot on the engine
        # thread (the shared prefix comes from the original's snapshot) and says so.
        self.open_session(branch.id, focus_prompt=True)

    # --- edit -----------------------------------------------------------------------------

    @work(group="action", exit_on_error=False)
    async def action_edit_message(self, view: MessageView | None = None) -> None:
        """F4 / ``e``: edit a past message of yours as a new branch, then regenerate.

        Without a selected message it edits your last one. The original is kept.
        """
        from kvchat.tui.replies import ActiveTurn

        session_id = self.session_id
        if view is None:
            view = self._focused_message()
            if view is None:
                mine = [v for v in self.conversation.views if v.role == "user"]
                view = mine[-1] if mine else None
        if session_id is None or view is None:
            self.notify("No message of yours to edit yet", severity="warning")
            return
        if view.role != "user":
            self.notify(
                "Only your own messages can be edited: Ctrl+R regenerates the last reply, "
                "f branches from this one",
                severity="warning",
            )
            return
        message_id = await self._branch_point(view, "edit a message")
        if message_id is None:
            return
        original = visible(view.text)  # what the message shows
        from kvchat.tui.screens.dialogs import EditDialog

        text: str | None = await self.app.push_screen_wait(EditDialog(original))
        if text is None:
            return
        if text == original.strip():
            self.notify("The message is unchanged: nothing to do")
            return
        if self.session_id != session_id or not self._idle("edit a message"):
            return
        # Hold the turn from now on, so nothing else starts while the branch is made.
        turn = ActiveTurn("regenerate", None, None)
        self.turn = turn
        self.status.set_turn("branching…", "busy")
        try:
            branch = await self.on_engine(self.service.edit, session_id, message_id, text)
        except BaseException as exc:
            self.turn = None
            if not isinstance(exc, KvchatError):
                self.status.set_turn("")
                raise
            self.status.set_turn(str(exc), "error")
            self.notify(str(exc), severity="error", markup=False)
            return
        turn.session_id = self.session_id = branch.id
        self._shown_id = None
        await self.conversation.show(await self.on_store(self.service.messages, branch.id))
        self._shown_id = branch.id
        await self.refresh_sessions()
        self.prompt.focus()
        self.notify(
            f"Edited into a new branch “{shorten(branch.title, 40)}”; the original is kept",
            markup=False,
        )
        # Like Ctrl+R: the reply streams in; the engine thread makes the branch hot with
        # the KV prefix it shares with the original.
        self.run_turn(turn)
