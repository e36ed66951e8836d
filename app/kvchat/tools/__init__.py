"""MCP tools: the client side. Servers from ``[mcp.servers.NAME]`` started only when enabled,
their tools listed and called through the official ``mcp`` SDK on one private event-loop
thread, every result bounded. Sits beside the engine: the service may import it; it imports
no service, TUI or CLI."""

from kvchat.tools.api import (
    Approval,
    ServerGoneError,
    ServerState,
    ServerStatus,
    ToolError,
    ToolResult,
    ToolSpec,
    ToolTimeoutError,
    Transport,
    UnknownToolError,
)
from kvchat.tools.box import ToolBox

__all__ = [
    "Approval",
    "ServerGoneError",
    "ServerState",
    "ServerStatus",
    "ToolError",
    "ToolResult",
    "ToolBox",
    "ToolSpec",
    "ToolTimeoutError",
    "Transport",
    "UnknownToolError",
]
