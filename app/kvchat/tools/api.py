"""The tools API the conversation side builds on: what a server offers (ToolSpec), what a
call gave (ToolResult), how each configured server stands (ServerState), and the errors.

Everything here is parsed and bounded at the boundary (kvchat.tools.parse); a failure of a
server or a call is a :class:`ToolError` carrying one clear line. A tool that answers with an
error of its own (MCP ``isError``) is a :class:`ToolResult` with ``is_error`` set, not an
exception: the model may read it and try again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvchat.errors import KvchatError

Transport = Literal["stdio", "http"]
# off: not enabled (never started); idle: enabled, not started yet; running: started and
# listed; failed: its start, list or a call failed (``error`` says why); stopped: closed;
# invalid: its config entry could not be read (``error`` says why).
ServerStatus = Literal["off", "idle", "running", "failed", "stopped", "invalid"]
Approval = Literal["ask", "always"]


class ToolError(KvchatError):
    """A server or a call failed: one clear line naming the server (and tool)."""


class ToolTimeoutError(ToolError):
    """A server's start, its tool list or a call took longer than its time cap."""


class ServerGoneError(ToolError):
    """A server process exited, could not be started, or its connection dropped."""


class UnknownToolError(ToolError):
    """No enabled, running server offers a tool of that qualified name."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool a server offers, bounded: ``input_schema`` is a JSON object schema."""

    server: str
    name: str
    description: str
    input_schema: dict[str, Any]

    @property
    def qualified(self) -> str:
        """``server.tool``: the name kvchat shows, stores and calls it by."""
        return f"{self.server}.{self.name}"


@dataclass(frozen=True)
class ToolResult:
    """What a call returned.

    ``text`` is what goes to the model: ``full_text`` cut at the result cap with a note saying
    so (``truncated``). ``full_text`` is the whole result, to keep in the store. Content that
    is not text (images, audio, resources) is a one-line note in both.
    """

    text: str
    full_text: str
    is_error: bool
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class ServerState:
    """One configured server as it stands now."""

    name: str
    transport: Transport
    enabled: bool
    approve: Approval
    status: ServerStatus
    error: str | None  # one line, where status is failed or invalid
    tools: int  # tools it listed (0 until it runs)
    target: str  # the command line or URL, for display (one line)
