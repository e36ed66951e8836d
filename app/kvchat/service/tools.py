"""Tools in a conversation: a turn whose reply calls a tool runs the call (once the user
approves it), stores the result as a message of role ``tool`` and lets the model go on.

The model is offered the session's tools through its chat template's own tools support
(``tools=``, rendered into the prompt's head; see :meth:`ToolTurns.offered`). A reply is read
for calls in the model's format (:mod:`kvchat.tools.calls`); each call is shown to the user
(:class:`CallRequest`) and approved once, always for that tool in the session (kept with it),
or denied; a server whose config says ``approve = "always"`` is not asked. Which tools are
off for a session is kept with it too. The result (what the model reads: the text
cut at the result cap; the whole text kept beside it) is a message of its own, appended:
the next decode reads only that message and the template's few tokens around it.

:class:`ToolTurns` is the service's collaborator for this (``service.tools``); it runs the
turns through the :class:`~kvchat.service.pipeline.TurnPipeline` and calls tools through a
:class:`ToolRunner` (the MCP client, ``kvchat.tools``; a test's stand-in).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvchat.engine import CancelCheck
from kvchat.errors import KvchatError
from kvchat.service.engine_host import EngineHost
from kvchat.service.pipeline import TurnOptions, TurnPipeline
from kvchat.service.reports import (
    TokenCallback,
    TurnReport,
    generation_params,
    session_tools,
    tool_switch_problem,
)
from kvchat.service.turn_lock import turn_lock
from kvchat.service.upkeep import Upkeep
from kvchat.store import Message, Store
from kvchat.store.locks import SessionLocks
from kvchat.store.tools_sql import StoredCall, ToolRecord
from kvchat.text import check_text, one_line
from kvchat.tools.api import ServerState, ToolError, ToolResult, ToolSpec
from kvchat.tools.calls import (
    CallFormat,
    ToolCall,
    ToolCallError,
    bounded_json,
    call_format,
    checked_arguments,
    parse_reply,
)

# What the user said to a call.
Decision = Literal["once", "always", "deny"]
# Model turns after the user's message, each reading tool results, at most.
MAX_ROUNDS = 4
# What the model reads for a call the user did not allow.
DENIED = "The user did not allow this call."


class ToolRunner(Protocol):
    """What calls tools: the MCP client's ToolBox, or a test's stand-in."""

    def servers(self) -> list[ServerState]: ...

    def tools(self) -> list[ToolSpec]: ...

    def call(
        self, qualified: str, arguments: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> ToolResult: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class CallRequest:
    """A call waiting for the user's approval: the tool and its arguments as they will go."""

    session_id: str
    qualified: str
    arguments: dict[str, Any]
    call_id: str
    description: str = ""
    by_model: bool = True  # False: typed by the user (/tool)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, indent=2)


Approver = Callable[[CallRequest], Decision]


@dataclass
class ToolStep:
    """One call and what came of it."""

    request: CallRequest
    decision: Decision
    message_id: int | None  # the tool message stored (None: it could not be stored)
    result: ToolResult | None  # None: denied, or the call failed (``line`` says why)
    line: str  # one line for the status bar

    @property
    def ran(self) -> bool:
        return self.result is not None


@dataclass
class ToolTurn:
    """A turn with its tool calls: each model reply's report, each call, and a line when the
    calls stopped short (a call that could not be read, too many rounds)."""

    reports: list[TurnReport]
    steps: list[ToolStep] = field(default_factory=list)
    note: str | None = None

    @property
    def report(self) -> TurnReport:
        """The last reply's report (the answer after the tools)."""
        return self.reports[-1]


def offered_tool(spec: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's function shape), by its qualified name."""
    return {
        "type": "function",
        "function": {
            "name": spec.qualified,
            "description": spec.description,
            "parameters": spec.input_schema,
        },
    }


def result_line(qualified: str, result: ToolResult) -> str:
    """A call's outcome in one line."""
    head = f"{qualified}: {'error' if result.is_error else 'done'} in {result.seconds:.2f} s"
    cut = f", cut to {len(result.text):,} of {len(result.full_text):,} characters"
    return head + (cut if result.truncated else "")


class ToolTurns:
    """Turns with tool calls and direct calls (``/tool``), for one service (see the module's
    docstring). Not thread-safe: a UI runs it on its engine thread."""

    def __init__(
        self,
        host: EngineHost,
        store: Store,
        locks: SessionLocks,
        turns: TurnPipeline,
        upkeep: Upkeep,
    ) -> None:
        self.host = host
        self.store = store
        self.locks = locks
        self.turns = turns
        self.upkeep = upkeep
        self.runner: ToolRunner | None = None
        # The reply format to read calls in; None: from the model's chat template.
        self.format: CallFormat | None = None
        self.max_rounds = MAX_ROUNDS
        self.timeout_s: float | None = None
        # A GBNF grammar the first reply of each turn follows (None: free text): a small
        # model that never calls a tool on its own is made to (the tests' forced call).
        self.grammar: str | None = None
        self._specs: list[ToolSpec] | None = None
        self._configured = False
        turns.offer_tools = self.offered

    # --- which tools -------------------------------------------------------------------------

    def attach(self, runner: ToolRunner | None) -> None:
        """Call tools through ``runner`` from now on (None: no tools)."""
        self.runner = runner
        self._specs = None

    def attach_configured(self) -> None:
        """Call tools through the config's ``[mcp.servers]`` (the MCP client; a server
        starts when its tools are first needed), unless a runner is attached already."""
        if self.runner is not None or self._configured:
            return
        self._configured = True
        mcp = self.host.settings.mcp
        if mcp.servers or mcp.problems:
            from kvchat.tools.box import ToolBox  # the SDK loads only where tools are set up

            self.attach(ToolBox.from_settings(self.host.settings))

    def specs(self) -> list[ToolSpec]:
        """Every tool the runner's running servers offer (listed once, then kept)."""
        if self.runner is None:
            return []
        if self._specs is None:
            self._specs = list(self.runner.tools())
        return self._specs

    def servers(self) -> list[ServerState]:
        return [] if self.runner is None else list(self.runner.servers())

    def enabled(self, session_id: str, qualified: str) -> bool:
        return qualified not in self._switched(session_id, "tools_off")

    def set_enabled(self, session_id: str, qualified: str, on: bool) -> None:
        """Turn a tool on or off for one session (the model is offered only those on); kept
        with the session."""
        self._switch(session_id, "tools_off", qualified, listed=not on)

    def always(self, session_id: str) -> frozenset[str]:
        """The tools the user let run in ``session_id`` without asking."""
        return self._switched(session_id, "tools_always")

    def set_always(self, session_id: str, qualified: str, always: bool) -> None:
        """Let a tool run in one session without asking (False: ask again); kept with the
        session."""
        self._switch(session_id, "tools_always", qualified, listed=always)

    def available(self, session_id: str) -> list[ToolSpec]:
        """The tools on for ``session_id``."""
        off = self._switched(session_id, "tools_off")
        return [s for s in self.specs() if s.qualified not in off]

    def _switched(self, session_id: str, switch: str) -> frozenset[str]:
        return session_tools(self.store.get_session(session_id).settings, switch)

    def _switch(self, session_id: str, switch: str, qualified: str, *, listed: bool) -> None:
        """Add ``qualified`` to the session's ``switch`` list, or take it out."""
        session = self.store.get_session(session_id)
        names = set(session_tools(session.settings, switch))
        if (qualified in names) == listed:
            return
        (names.add if listed else names.discard)(qualified)
        settings = {k: v for k, v in session.settings.items() if k != switch}
        if names:
            problem = tool_switch_problem(switch, sorted(names))
            if problem is not None:
                raise KvchatError(problem)
            settings[switch] = sorted(names)
        self.store.update_session(session_id, settings=settings)

    def offered(self, session_id: str) -> list[dict[str, Any]] | None:
        """What the chat template is given as ``tools`` for this session's prompts (None:
        none, and the prompt is the same as without tools)."""
        tools = [offered_tool(spec) for spec in self.available(session_id)]
        return tools or None

    def call_format(self) -> CallFormat:
        """The format replies are read in: the one set, else the model template's; one line
        when the template shows none."""
        if self.format is not None:
            return self.format
        engine = self.host.load()
        level = engine.token_level()
        template = level.metadata.get("tokenizer.chat_template") if level is not None else None
        return call_format(template, engine.model_name)

    # --- turns --------------------------------------------------------------------------------

    def send(
        self,
        session_id: str,
        text: str,
        approve: Approver,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> ToolTurn:
        """``ChatService.send``, then the calls its reply makes, each approved by
        ``approve`` and its result stored, and the model's turn after them (up to
        :attr:`max_rounds`). ``overrides`` apply to the first reply (a ``grammar`` only
        there: the model's answer after a result is free)."""
        options = TurnOptions(on_token, cancel, no_restore)
        overrides = self._first(overrides)
        first = self.turns.send(session_id, text, options, dict(overrides), None)
        return self.follow(session_id, first, approve, options, overrides)

    def answer(
        self,
        session_id: str,
        message_id: int,
        approve: Approver,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        **overrides: Any,
    ) -> ToolTurn:
        """``ChatService.answer`` (a message posted already), then its calls as :meth:`send`."""
        options = TurnOptions(on_token, cancel)
        overrides = self._first(overrides)
        first = self.turns.answer(session_id, message_id, options, dict(overrides))
        return self.follow(session_id, first, approve, options, overrides)

    def _first(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """The first reply's overrides: :attr:`grammar` unless the caller gave one."""
        if self.grammar is None or "grammar" in overrides:
            return overrides
        return {**overrides, "grammar": self.grammar}

    def follow(
        self,
        session_id: str,
        report: TurnReport,
        approve: Approver,
        options: TurnOptions,
        overrides: dict[str, Any],
    ) -> ToolTurn:
        """Run the calls ``report``'s reply makes and the model's turns after them."""
        turn = ToolTurn([report])
        later = {k: v for k, v in overrides.items() if k != "grammar"}
        for _ in range(self.max_rounds):
            calls = self._calls_of(turn)
            if not calls:
                return turn
            if options.cancel is not None and options.cancel():
                turn.note = "stopped: the calls were not run"
                return turn
            for call in calls:
                turn.steps.append(self._run_call(session_id, call, approve))
            turn.reports.append(self._model_turn(session_id, options, later))
        if self._calls_of(turn, record=False):
            turn.note = f"the model kept calling tools: stopped after {self.max_rounds} rounds"
        return turn

    def _calls_of(self, turn: ToolTurn, record: bool = True) -> list[ToolCall]:
        """The calls the turn's last reply makes (recorded with its message), [] when none;
        a call that cannot be read is the turn's note."""
        report = turn.report
        if report.message_id is None or not report.reply or self.runner is None:
            return []
        try:
            fmt = self.call_format()
            # A harmony call's header is markup the reasoning split takes out of the reply.
            text = report.written if fmt is CallFormat.HARMONY and report.written else report.reply
            parsed = parse_reply(text, fmt)
        except ToolCallError as exc:
            turn.note = one_line(str(exc))
            return []
        calls = [
            c if c.call_id else ToolCall(c.name, c.arguments, f"call_{secrets.token_hex(4)}")
            for c in parsed.calls
        ]
        if calls and record:
            self.store.set_tool_calls(
                report.message_id, [(c.call_id, c.name, c.arguments_json) for c in calls]
            )
        return calls

    def _model_turn(
        self, session_id: str, options: TurnOptions, overrides: dict[str, Any]
    ) -> TurnReport:
        """The model's reply to the session as it stands (ending with tool results). A
        settle the last reply left pending runs first: the context then holds the history
        as its prompt renders it, and only the results are read."""
        if self.upkeep.pending:
            self.upkeep.run_pending()
        session = self.store.get_session(session_id)
        params = generation_params(self.host.settings, session.settings, overrides)
        with turn_lock(self.locks, session_id):
            return self.turns.run(session_id, params, options)

    # --- calls --------------------------------------------------------------------------------

    def _spec(self, session_id: str, name: str) -> ToolSpec | None:
        """The tool a model's ``name`` means: its qualified name, or a tool's own name where
        one tool on for the session has it."""
        tools = self.available(session_id)
        for spec in tools:
            if spec.qualified == name:
                return spec
        same = [spec for spec in tools if spec.name == name]
        return same[0] if len(same) == 1 else None

    def _needs_asking(self, session_id: str, spec: ToolSpec) -> bool:
        if spec.qualified in self.always(session_id):
            return False
        for state in self.servers():
            if state.name == spec.server:
                return state.approve != "always"
        return True

    def _run_call(self, session_id: str, call: ToolCall, approve: Approver) -> ToolStep:
        """Ask, call and store one call the model made."""
        spec = self._spec(session_id, call.name)
        if spec is None:
            request = CallRequest(session_id, call.name, call.arguments, call.call_id)
            text = f"No tool named {call.name} is available."
            line = f"the model called {one_line(call.name)[:80]}, which no tool on here is"
            return self._store_outcome(request, "deny", None, text, line, is_error=True)
        request = CallRequest(
            session_id, spec.qualified, call.arguments, call.call_id, spec.description
        )
        return self.run_request(request, approve)

    def run_request(self, request: CallRequest, approve: Approver | None) -> ToolStep:
        """Ask about ``request`` (unless its tool needs no asking; ``approve`` None: it was
        asked already), call it when allowed, and store the outcome as a tool message."""
        spec = self._spec(request.session_id, request.qualified)
        if spec is None:
            raise KvchatError(f"no tool named {one_line(request.qualified)[:80]} is on here")
        decision: Decision = "once"
        if approve is not None and self._needs_asking(request.session_id, spec):
            decision = approve(request)
        if decision == "always":
            try:
                self.set_always(request.session_id, spec.qualified, True)
            except KvchatError:
                pass  # not kept (a full disk: storing the result says so); asked again next time
        if decision == "deny":
            line = f"{spec.qualified}: not allowed"
            return self._store_outcome(request, decision, None, DENIED, line, is_error=True)
        assert self.runner is not None
        try:
            result = self.runner.call(spec.qualified, request.arguments, timeout_s=self.timeout_s)
        except ToolError as exc:
            line = one_line(str(exc))
            text = f"The call failed: {line}"
            return self._store_outcome(request, decision, None, text, line, is_error=True)
        line = result_line(spec.qualified, result)
        return self._store_outcome(request, decision, result, result.text, line, result.is_error)

    def _store_outcome(
        self,
        request: CallRequest,
        decision: Decision,
        result: ToolResult | None,
        text: str,
        line: str,
        is_error: bool,
    ) -> ToolStep:
        """Store the tool message for a call: what the model reads, and the record."""
        text = check_text(text, "the tool's result")
        record = ToolRecord(
            message_id=0,
            name=request.qualified,
            call_id=request.call_id,
            arguments=json.dumps(request.arguments, ensure_ascii=False),
            is_error=is_error,
            truncated=bool(result and result.truncated),
            full_text=result.full_text if result is not None else text,
            seconds=result.seconds if result is not None else None,
        )
        loaded = self.host.loaded
        level = loaded.token_level() if loaded is not None else None
        count = level.count_tokens(text) if level is not None else 0
        message_id: int | None = None
        try:
            message = self.store.add_tool_message(
                request.session_id, text, record, token_count=count
            )
            message_id = message.id
        except KvchatError as exc:
            line = f"{line}; the result could not be saved: {one_line(str(exc))}"
        return ToolStep(request, decision, message_id, result, line)

    def call_directly(
        self, session_id: str, qualified: str, arguments: str | dict[str, Any], approve: Approver
    ) -> ToolStep:
        """Run a tool the user named (``/tool NAME {json}``, ``kvchat tools call``) and put
        its result into the conversation as a tool message; no model turn follows."""
        if isinstance(arguments, str):
            parsed = bounded_json(arguments, "the arguments") if arguments.strip() else {}
            arguments = checked_arguments(parsed, "the call")
        self.store.get_session(session_id)  # an unknown session is one line, before the call
        if self.runner is None:
            raise KvchatError("no tools are set up: add an [mcp.servers.NAME] to the config")
        spec = self._spec(session_id, qualified)
        if spec is None:
            names = ", ".join(s.qualified for s in self.available(session_id)) or "none"
            raise KvchatError(f"no tool named {one_line(qualified)[:80]} is on here (on: {names})")
        request = CallRequest(
            session_id,
            spec.qualified,
            arguments,
            f"call_{secrets.token_hex(4)}",
            spec.description,
            by_model=False,
        )
        return self.run_request(request, approve)

    # --- reading back --------------------------------------------------------------------------

    def records(self, messages: list[Message]) -> dict[int, ToolRecord]:
        """The tool records of those of ``messages`` that are tool messages."""
        return self.store.tool_records([m.id for m in messages if m.role == "tool"])

    def calls(self, messages: list[Message]) -> dict[int, list[StoredCall]]:
        """The calls those of ``messages`` that are replies made."""
        return self.store.tool_calls([m.id for m in messages if m.role == "assistant"])

    def close(self) -> None:
        """Stop the runner's servers (at quit)."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()
