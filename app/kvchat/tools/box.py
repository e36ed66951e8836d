"""ToolBox: every configured MCP server behind a synchronous API.

The SDK runs on one private event loop in a daemon thread; each method here hands it a
coroutine and waits with a time cap (a start, a tool list, a call). A server is started only
when it is enabled, on the first :meth:`ToolBox.tools` or :meth:`ToolBox.call` that needs
it, and every process started is stopped by :meth:`ToolBox.close`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.config import McpServerConfig
from kvchat.tools.api import (
    Approval,
    ServerGoneError,
    ServerState,
    ServerStatus,
    ToolError,
    ToolResult,
    ToolSpec,
    ToolTimeoutError,
    UnknownToolError,
)
from kvchat.tools.client import Connection, target_of, transport_of
from kvchat.tools.parse import (
    RESULT_CAP_CHARS,
    check_arguments,
    parse_result,
    parse_tool_list,
    quoted,
    split_qualified,
)

if TYPE_CHECKING:
    from kvchat.config import Settings

T = TypeVar("T")
# Past the coroutine's own cap, how long the caller's thread waits for the loop to answer.
_LOOP_GRACE_S = 10.0
_CLOSE_TIMEOUT_S = 10.0
_PING_WAIT_S = 5.0


@dataclass
class _Server:
    name: str
    config: McpServerConfig | None  # None: its config entry could not be read
    enabled: bool
    status: ServerStatus
    error: str | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # tools left out, one line each
    connection: Connection | None = None
    # Held while this server starts (the box's lock is not: servers() answers meanwhile).
    starting: threading.Lock = field(default_factory=threading.Lock)


class ToolBox:
    """Every configured server; starts one only when it is enabled. Thread-safe."""

    def __init__(
        self,
        servers: Mapping[str, McpServerConfig],
        *,
        problems: Mapping[str, str] | None = None,
        result_cap_chars: int = RESULT_CAP_CHARS,
    ) -> None:
        self._result_cap = max(1, result_cap_chars)
        self._servers: dict[str, _Server] = {}
        for name, config in servers.items():
            status: ServerStatus = "idle" if config.enabled else "off"
            self._servers[name] = _Server(name, config, config.enabled, status)
        for name, problem in (problems or {}).items():
            self._servers[name] = _Server(name, None, False, "invalid", error=problem)
        self._lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # What the loop's default handler would have written to stderr (an error no task
        # took up), one line each: kept for a test to assert there are none, never shown.
        self.unhandled: list[str] = []

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> ToolBox:
        """The servers of ``[mcp.servers.*]`` (none started yet)."""
        return cls(settings.mcp.servers, problems=settings.mcp.problems, **options)

    # -- the loop -------------------------------------------------------------------------

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        line = f"{context.get('message', '')}: {error!r}" if error else context.get("message", "")
        self.unhandled.append(quoted(str(line)))

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the private loop (started on first use) and wait for it."""
        with self._lock:
            if self._closed:
                coro.close()
                raise ToolError("the tool box is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                loop.set_exception_handler(self._unhandled)
                thread = threading.Thread(target=loop.run_forever, name="kvchat-tools", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            loop = self._loop
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout_s + _LOOP_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolTimeoutError(
                f"the tools' event loop did not answer in {timeout_s:g} s"
            ) from None
        except concurrent.futures.CancelledError:
            raise ToolError("the tool box was closed meanwhile") from None

    # -- servers --------------------------------------------------------------------------

    def servers(self) -> list[ServerState]:
        """Every configured server as it stands now, by name."""
        with self._lock:
            rows = []
            for server in sorted(self._servers.values(), key=lambda s: s.name):
                self._notice_loss(server)
                config = server.config
                rows.append(
                    ServerState(
                        name=server.name,
                        transport=transport_of(config) if config else "stdio",
                        enabled=server.enabled,
                        approve=config.approve if config else "ask",
                        status=server.status,
                        error=server.error,
                        tools=len(server.tools),
                        target=target_of(config) if config else "",
                    )
                )
            return rows

    def notes(self, name: str) -> list[str]:
        """Lines about tools ``name`` listed that were left out (bad names, schemas)."""
        with self._lock:
            server = self._servers.get(name)
            return list(server.notes) if server else []

    def approval(self, name: str) -> Approval:
        """The server's default for its calls: ask each time, or always run."""
        server = self._get(name)
        return server.config.approve if server.config else "ask"

    def set_enabled(self, name: str, enabled: bool) -> None:
        """Turn a server on (started at the next use) or off (stopped now)."""
        server = self._get(name)
        if server.config is None:
            raise ToolError(f"server {name} cannot be enabled: {server.error}")
        if not enabled:
            self._stop(server)
        with self._lock:
            server.enabled = enabled
            if server.connection is None:
                server.status = "idle" if enabled else "off"

    def _get(self, name: str) -> _Server:
        with self._lock:
            server = self._servers.get(name)
        if server is None:
            known = ", ".join(sorted(self._servers)) or "none is configured"
            raise ToolError(f"no MCP server named {quoted(name)} (servers: {known})")
        return server

    def _notice_loss(self, server: _Server) -> None:
        """A running server whose connection ended (its process exited) is failed."""
        connection = server.connection
        if server.status == "running" and connection is not None and not connection.alive:
            server.status = "failed"
            server.error = f"it stopped: {connection.lost or 'its connection ended'}"
            server.connection = None

    def start(self) -> list[ServerState]:
        """Start every enabled server that is not running, side by side (each within its
        timeout_s); a failure is the server's state and error line, not an exception."""
        waiting = [s for s in self._servers.values() if s.enabled and s.config is not None]
        if waiting:
            # Side by side: one slow server costs its own time cap, not everyone's.
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, len(waiting)), thread_name_prefix="kvchat-mcp-start"
            ) as pool:
                for done in [pool.submit(self._ensure, server) for server in waiting]:
                    try:
                        done.result()
                    except ToolError:
                        pass  # the server's state says why
        return self.servers()

    def _ensure(self, server: _Server) -> Connection:
        """``server`` running: started now if it is enabled and not running."""
        with server.starting:
            with self._lock:
                self._notice_loss(server)
                if server.connection is not None:
                    return server.connection
                config = server.config
                if config is None:
                    raise ToolError(f"server {server.name} is not usable: {server.error}")
                if not server.enabled:
                    raise ToolError(f"server {server.name} is not enabled")
            connection = Connection(server.name, config)
            try:
                raw = self._run(connection.start(config.timeout_s), config.timeout_s)
                tools, notes = parse_tool_list(server.name, raw)
            except ToolError as exc:
                if connection.alive:
                    self._run(connection.stop(5.0), 5.0)
                with self._lock:
                    server.status, server.error, server.tools = "failed", str(exc), []
                raise
            with self._lock:
                server.connection, server.tools, server.notes = connection, tools, notes
                server.status, server.error = "running", None
            return connection

    def _stop(self, server: _Server) -> None:
        with self._lock:
            connection, server.connection = server.connection, None
            if server.status in ("running", "failed"):
                server.status = "stopped"
        if connection is not None and self._loop is not None:
            try:
                self._run(connection.stop(_CLOSE_TIMEOUT_S), _CLOSE_TIMEOUT_S)
            except ToolError:
                pass

    # -- tools ----------------------------------------------------------------------------

    def tools(self) -> list[ToolSpec]:
        """The tools of every enabled server, starting those not started yet (a server that
        fails to start offers none: its state says why)."""
        self.start()
        with self._lock:
            return [
                spec
                for server in sorted(self._servers.values(), key=lambda s: s.name)
                if server.status == "running"
                for spec in server.tools
            ]

    def find(self, qualified: str) -> ToolSpec:
        """The tool named ``server.tool`` (its server started if need be), or a ToolError."""
        name, tool = split_qualified(qualified)
        server = self._get(name)
        self._ensure(server)
        for spec in server.tools:
            if spec.name == tool:
                return spec
        offered = ", ".join(spec.name for spec in server.tools[:20]) or "none"
        raise UnknownToolError(
            f"server {name} offers no tool {quoted(tool)} (it offers: {offered})"
        )

    def call(
        self,
        qualified: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        result_cap_chars: int | None = None,
    ) -> ToolResult:
        """Call ``server.tool`` with ``arguments`` (a JSON object) and wait at most
        ``timeout_s`` (default: the server's). A tool's own error is a result with
        ``is_error``; a timeout, a server that ends or cannot start is a ToolError."""
        spec = self.find(qualified)
        args = check_arguments(qualified, arguments)
        server = self._get(spec.server)
        connection = self._ensure(server)
        if not self._run(connection.still_there(), _PING_WAIT_S):
            with self._lock:
                if server.connection is connection:
                    server.connection, server.status = None, "failed"
            self._run(connection.stop(0.0), _CLOSE_TIMEOUT_S)
            connection = self._ensure(server)  # started again (or a one-line failure)
        assert server.config is not None
        cap_s = server.config.timeout_s if timeout_s is None else timeout_s
        if not 0 < cap_s <= 24 * 3600:
            raise ToolError(f"a call's time cap must be 0-86400 s, not {cap_s!r}")
        began = time.monotonic()
        try:
            raw = self._run(connection.call(spec.name, args, cap_s), cap_s)
        except ServerGoneError as exc:
            with self._lock:
                server.status, server.error, server.connection = "failed", str(exc), None
            self._run(connection.stop(5.0), 5.0)
            raise
        seconds = time.monotonic() - began
        return parse_result(raw, seconds=seconds, cap=result_cap_chars or self._result_cap)

    # -- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every server process started and the loop. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            servers = list(self._servers.values())
        for server in servers:
            self._stop(server)
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            # A start or call still under way (another thread's) is cancelled: its server's
            # process is ended by the transport, and its caller gets one line.
            leftover = asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
            try:
                leftover.result(_CLOSE_TIMEOUT_S)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_CLOSE_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _cancel_all() -> None:
    """Cancel every other task on the loop and wait for them (a bounded time)."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S / 2)
