"""Tools in the app: ``/tool NAME {json}`` runs a tool and puts its result into the
conversation; ``/tools`` lists the servers and tools and which are on for this session
(``/tools on NAME`` / ``/tools off NAME``; ``/tools ask NAME`` takes back an "always"; all
kept with the session); every call waits for the user's answer in
:class:`~kvchat.tui.screens.tool_call.ToolCallDialog` (a model's calls too: see
:meth:`ToolCalls.approver`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.text import one_line
from kvchat.tui.main.context import Job
from kvchat.tui.main.screen_state import ready_or_say
from kvchat.tui.screens.tool_call import ToolCallDialog, ToolsDialog

if TYPE_CHECKING:
    from kvchat.service.tools import Approver, CallRequest, Decision, ToolStep, ToolTurns
    from kvchat.tui.main.context import ScreenContext
    from kvchat.tui.main.opener import SessionOpener

TOOL_CALL = Job("tool_call", "tools")
TOOL_LIST = Job("tool_list", "tools")


class ToolCalls:
    """The main screen's tool commands and the approval of calls (see the module)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener
        ctx.slash.register(
            "tool",
            "Run a tool and put its result into the conversation",
            "/tool NAME {json}",
            self._tool_typed,
        )
        ctx.slash.register(
            "tools",
            "The tools, and which are on for this session (on|off NAME: switch one; ask NAME: "
            "ask again before it runs)",
            "/tools [on|off|ask NAME]",
            self._tools_typed,
        )

    def approver(self) -> Approver:
        """An approval for the engine thread: shows the dialog on the UI thread and waits
        for the answer there."""
        app = self.ctx.app

        def approve(request: CallRequest) -> Decision:
            answer: Future[Decision] = Future()

            def ask() -> None:
                app.push_screen(ToolCallDialog(request), lambda d: answer.set_result(d or "deny"))

            app.call_from_thread(ask)
            # The app may quit with the dialog open: its answer never comes, and the engine
            # thread must not wait for it forever (quitting waits for that thread).
            while True:
                try:
                    return answer.result(timeout=0.5)
                except TimeoutError:
                    if not app.is_running:
                        return "deny"

        return approve

    # --- /tool ------------------------------------------------------------------------------

    def _tool_typed(self, text: str) -> None:
        name, _, arguments = text.strip().partition(" ")
        if not name:
            self.ctx.app.notify(
                "/tool NAME {json}: name a tool (/tools lists them)", severity="warning"
            )
            return
        session_id = self.ctx.state.session_id
        if session_id is None or not ready_or_say(self.ctx.app, self.ctx.state):
            return
        self.ctx.run(TOOL_CALL, self._call, session_id, name, arguments)

    async def _call(self, session_id: str, name: str, arguments: str) -> None:
        approve = self.approver()
        self.ctx.status.set_turn(f"calling {one_line(name)[:60]}…", "busy")
        try:
            step: ToolStep = await self.ctx.backend.on_engine(
                self._engine_call, session_id, name, arguments, approve
            )
        except KvchatError as exc:
            self.ctx.status.set_turn("", "idle")
            self.ctx.app.notify(one_line(str(exc)), severity="error", timeout=8)
            return
        self.ctx.status.set_turn(step.line, "warning" if step.result is None else "idle")
        if self.ctx.state.session_id == session_id:
            await self.opener.show_latest(lazy=True)

    def _engine_call(
        self, session_id: str, name: str, arguments: str, approve: Approver
    ) -> ToolStep:
        tools = self.ctx.backend.chat.tools
        tools.attach_configured()
        return tools.call_directly(session_id, name, arguments, approve)

    # --- /tools -----------------------------------------------------------------------------

    def _tools_typed(self, text: str) -> None:
        if text.strip():
            self.ctx.run(TOOL_LIST, self._list, text.strip())
        else:
            self.ctx.run(TOOL_LIST, self._dialog)

    async def _dialog(self) -> None:
        """``/tools``: the dialog of servers and tools; the tools checked are on."""
        session_id = self.ctx.state.session_id
        try:
            servers, tools, note = await self.ctx.backend.on_engine(self._engine_state, session_id)
        except KvchatError as exc:
            self.ctx.app.notify(one_line(str(exc)), severity="error", timeout=8)
            return
        on = await self.ctx.app.push_screen_wait(ToolsDialog(servers, tools, note))
        if on is None or session_id is None:
            return
        changes = [(name, name in on) for name, was in tools if (name in on) != was]
        if changes:
            try:
                await self.ctx.backend.on_engine(self._engine_switch, session_id, changes)
            except KvchatError as exc:
                self.ctx.app.notify(one_line(str(exc)), severity="error", timeout=8)
                return
            self.ctx.app.notify(
                ", ".join(f"{name} {'on' if now else 'off'}" for name, now in changes),
                title="Tools",
                markup=False,
            )

    def _engine_state(
        self, session_id: str | None
    ) -> tuple[list[str], list[tuple[str, bool]], str]:
        tools = self.ctx.backend.chat.tools
        tools.attach_configured()
        servers = [line for line in tool_lines(tools, session_id) if not line.startswith("  ")]
        specs = tools.specs()
        on = {s.qualified for s in (specs if session_id is None else tools.available(session_id))}
        listed = [(spec.qualified, spec.qualified in on) for spec in specs]
        try:
            note = f"Replies are read for calls as {tools.call_format().value}"
        except KvchatError as exc:
            note = one_line(str(exc))
        return servers, listed, note

    def _engine_switch(self, session_id: str, changes: list[tuple[str, bool]]) -> None:
        for name, on in changes:
            self.ctx.backend.chat.tools.set_enabled(session_id, name, on)

    async def _list(self, text: str) -> None:
        session_id = self.ctx.state.session_id
        try:
            lines = await self.ctx.backend.on_engine(self._engine_list, session_id, text)
        except KvchatError as exc:
            self.ctx.app.notify(one_line(str(exc)), severity="error", timeout=8)
            return
        self.ctx.app.notify("\n".join(lines), title="Tools", timeout=15, markup=False)

    def _engine_list(self, session_id: str | None, text: str) -> list[str]:
        tools = self.ctx.backend.chat.tools
        tools.attach_configured()
        switch, _, name = text.partition(" ")
        if switch in ("on", "off", "ask"):
            if session_id is None or not name.strip():
                raise KvchatError(f"/tools {switch} NAME: open a session and name a tool")
            known = {s.qualified for s in tools.specs()}
            if name.strip() not in known:
                raise KvchatError(f"no tool named {one_line(name)[:80]}: /tools lists them")
            if switch == "ask":
                tools.set_always(session_id, name.strip(), False)
            else:
                tools.set_enabled(session_id, name.strip(), switch == "on")
        elif text:
            raise KvchatError("/tools [on|off|ask NAME]")
        lines = tool_lines(tools, session_id)
        try:
            lines.append(f"Replies are read for calls as {tools.call_format().value}")
        except KvchatError as exc:
            lines.append(one_line(str(exc)))
        return lines


def tool_lines(tools: ToolTurns, session_id: str | None) -> list[str]:
    """Each server (its state) and its tools, marked on or off for the session (and
    "always" where the user let one run in it without asking)."""
    servers = tools.servers()
    if not servers:
        return ["No tool servers: add [mcp.servers.NAME] to the config"]
    specs = tools.specs()
    on = {s.qualified for s in (specs if session_id is None else tools.available(session_id))}
    always = frozenset() if session_id is None else tools.always(session_id)
    lines = []
    for server in servers:
        why = f" ({one_line(server.error)[:100]})" if server.error else ""
        lines.append(f"{one_line(server.name)} · {server.status} · approve {server.approve}{why}")
        for spec in (s for s in specs if s.server == server.name):
            mark = "[x]" if spec.qualified in on else "[ ]"
            asks = " · always" if spec.qualified in always else ""
            lines.append(f"  {mark} {one_line(spec.qualified)}{asks}")
    return lines
