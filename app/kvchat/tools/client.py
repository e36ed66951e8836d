"""One MCP server's connection, run on the tool box's event loop.

The SDK is async and its context managers (the transport, the session) must be entered and
left by one task: :meth:`Connection.serve` is that task, for the life of the connection.
Starting, listing and calling are awaited from other tasks on the same loop, each under a
time cap. Nothing here blocks a thread but the loop's own.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import shlex
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import anyio

from kvchat.config import McpServerConfig
from kvchat.tools.api import ServerGoneError, ToolError, ToolTimeoutError, Transport
from kvchat.tools.parse import quoted

# Bytes kept of what a stdio server writes to stderr: its last line explains a failure.
STDERR_TAIL_BYTES = 4096
# One streamed HTTP event (a result) read at most: the SDK's own default is 1 MiB, under the
# results kvchat keeps (a 10 MB page); past this the call fails with one line.
MAX_HTTP_EVENT_BYTES = 64 * 1024 * 1024
# A server idle this long is pinged before a call (see Connection.still_there).
IDLE_CHECK_S = 1.0
PING_TIMEOUT_S = 2.0
# Pages of tools/list read at most (a server whose cursor never ends).
MAX_LIST_PAGES = 64


def transport_of(config: McpServerConfig) -> Transport:
    return "stdio" if config.command is not None else "http"


def target_of(config: McpServerConfig) -> str:
    """The command line or URL, for a message or a table (one line)."""
    if config.command is not None:
        return quoted(shlex.join([config.command, *config.args]))
    return quoted(config.url or "")


class StderrTail:
    """A pipe a server writes its stderr into; a thread keeps only its last bytes (nothing
    reaches kvchat's terminal or disk)."""

    def __init__(self) -> None:
        read_fd, write_fd = os.pipe()
        self.writer = os.fdopen(write_fd, "w")
        self._read_fd = read_fd
        self._tail = b""
        self.written = 0  # bytes the server wrote to stderr so far
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, name="kvchat-mcp-stderr", daemon=True).start()

    def _drain(self) -> None:
        try:
            while chunk := os.read(self._read_fd, 65536):
                with self._lock:
                    self._tail = (self._tail + chunk)[-STDERR_TAIL_BYTES:]
                    self.written += len(chunk)
        except OSError:
            pass
        finally:
            os.close(self._read_fd)

    def close_writer(self) -> None:
        """Our copy of the pipe's write end (the server holds its own until it exits)."""
        if not self.writer.closed:
            self.writer.close()

    def last_line(self, since: int = 0) -> str:
        """The last line written, if the server wrote anything after ``since`` bytes."""
        with self._lock:
            if self.written <= since:
                return ""
            lines = self._tail.decode("utf-8", "replace").strip().splitlines()
        return quoted(lines[-1]) if lines else ""


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """An error from the SDK, a transport or the OS as a short phrase."""
    leaf = _leaf(exc)
    if isinstance(leaf, FileNotFoundError):
        return f"no such command ({quoted(leaf.filename or leaf)})"
    if isinstance(leaf, OSError):
        return quoted(leaf.strerror or leaf)
    text = quoted(str(leaf)) if str(leaf) else type(leaf).__name__
    name = type(leaf).__name__
    plain = ("MCPError", "McpError", "ToolError", "RuntimeError")
    return text if name in plain else f"{name}: {text}"


def _stdio(config: McpServerConfig, errlog: Any) -> AbstractAsyncContextManager[tuple[Any, ...]]:
    from mcp import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=config.command or "", args=list(config.args), env=dict(config.env) or None
    )
    return stdio_client(params, errlog=errlog)


@asynccontextmanager
async def _http(config: McpServerConfig) -> AsyncIterator[tuple[Any, ...]]:
    url = config.url or ""
    try:  # mcp 2
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client
    except ImportError:  # mcp 1.x
        from mcp.client.streamable_http import (  # type: ignore[attr-defined,unused-ignore]
            streamablehttp_client,
        )

        async with streamablehttp_client(url, headers=dict(config.headers) or None) as streams:
            yield tuple(streams)
        return
    options: dict[str, Any] = {}
    if "max_sse_event_size" in inspect.signature(streamable_http_client).parameters:
        options["max_sse_event_size"] = MAX_HTTP_EVENT_BYTES
    async with (
        create_mcp_http_client(headers=dict(config.headers) or None) as client,
        streamable_http_client(url, http_client=client, **options) as streams,
    ):
        yield tuple(streams)


def quiet_sdk_logs() -> None:
    """The SDK logs a server's faults through ``logging``, tracebacks and all (which, with no
    handler set, Python writes to stderr: over the app's screen). kvchat says each in one
    line instead, so the SDK's loggers are kept quiet."""
    for name in ("mcp", "httpx", "httpx2"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())
        logger.propagate = False


class Connection:
    """A started server: its session, its listed tools (wire shape), how it ended."""

    def __init__(self, name: str, config: McpServerConfig) -> None:
        quiet_sdk_logs()
        self.name = name
        self.config = config
        self.session: Any = None
        self.lost: str | None = None  # why a running connection ended
        self.last_used = 0.0  # time.monotonic() of its last answer
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stderr = StderrTail() if config.command is not None else None

    def _why(self, exc: BaseException, since: int = 0) -> str:
        line = self._stderr.last_line(since) if self._stderr is not None else ""
        reason = describe(exc)
        return f"{reason} (its stderr: {line})" if line and line not in reason else reason

    async def start(self, timeout_s: float) -> list[Any]:
        """Start the server and list its tools (every page), within ``timeout_s``."""
        ready: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(_taken)  # an outcome that comes after a timeout is dropped
        self._task = asyncio.create_task(self._serve(ready), name=f"mcp {self.name}")
        try:
            return await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except TimeoutError:
            await self.stop(timeout_s=0.0)  # it is mid-handshake: no goodbye to wait for
            raise ToolTimeoutError(
                f"server {self.name} did not start and list its tools within {timeout_s:g} s"
            ) from None
        except ToolError:
            await self.stop(timeout_s=5.0)
            raise
        except Exception as exc:
            await self.stop(timeout_s=5.0)
            raise ServerGoneError(f"server {self.name} could not start: {self._why(exc)}") from None

    async def _serve(self, ready: asyncio.Future[list[Any]]) -> None:
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                if self._stderr is not None:
                    streams = await stack.enter_async_context(
                        _stdio(self.config, self._stderr.writer)
                    )
                else:
                    streams = await stack.enter_async_context(_http(self.config))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools: list[Any] = []
                cursor: str | None = None
                for _page in range(MAX_LIST_PAGES):
                    listed = await session.list_tools(**_cursor_params(cursor))
                    dumped = listed.model_dump(mode="json", by_alias=True)
                    tools.extend(dumped.get("tools") or [])
                    cursor = dumped.get("nextCursor")
                    if not cursor:
                        break
                self.session = session
                self.last_used = time.monotonic()
                if not ready.done():
                    ready.set_result(tools)
                await self._stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except BaseException as exc:  # the SDK's task groups raise groups of anything
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
            else:
                self.lost = self._why(exc)
        finally:
            self.session = None
            if self.lost is None and not self._stop.is_set():
                self.lost = "its connection ended"
            if self._stderr is not None:
                self._stderr.close_writer()

    @property
    def alive(self) -> bool:
        return self.session is not None and self._task is not None and not self._task.done()

    async def still_there(self) -> bool:
        """Whether the server still answers, asked (a ping) only when it has been idle for
        :data:`IDLE_CHECK_S`: a server that exited between calls is started again before
        the next call rather than failing it. Only a closed connection counts as gone (a
        busy server, or one without ping, is there)."""
        if not self.alive:
            return False
        if time.monotonic() - self.last_used < IDLE_CHECK_S:
            return True
        try:
            await asyncio.wait_for(self.session.send_ping(), PING_TIMEOUT_S)
        except Exception as exc:
            if _connection_closed(exc):
                self.lost = "it had exited since its last call"
                self.session = None
                return False
        self.last_used = time.monotonic()
        return self.alive

    async def call(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        """Call ``tool``; the result in wire shape. A timeout, a lost connection or a
        protocol error is a one-line ToolError."""
        qualified = f"{self.name}.{tool}"
        if not self.alive:
            raise ServerGoneError(f"server {self.name} is not running ({self.lost or 'stopped'})")
        assert self._task is not None
        since = self._stderr.written if self._stderr is not None else 0
        self.last_used = time.monotonic()
        call = asyncio.ensure_future(self.session.call_tool(tool, arguments))
        ended = asyncio.ensure_future(asyncio.shield(self._task))
        ended.add_done_callback(_taken)
        call.add_done_callback(_taken)  # a call given up on (its time cap) may end later
        try:
            done, _ = await asyncio.wait(
                {call, ended}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ended.cancel()
        if call in done:
            try:
                return call.result().model_dump(mode="json", by_alias=True)
            except Exception as exc:
                if _connection_closed(exc):
                    self.lost = self._why(RuntimeError("its connection closed"), since)
                    self.session = None
                if not self.alive:
                    raise ServerGoneError(
                        f"server {self.name} ended during {qualified}: {self.lost or describe(exc)}"
                    ) from None
                raise ToolError(f"{qualified} failed: {describe(exc)}") from None
        call.cancel()
        if not self.alive:
            raise ServerGoneError(
                f"server {self.name} ended during {qualified}: {self.lost or 'its connection ended'}"
            )
        raise ToolTimeoutError(f"{qualified} gave no result within {timeout_s:g} s")

    async def stop(self, timeout_s: float) -> None:
        """Leave the session and the transport (a stdio server's process is ended)."""
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            if timeout_s <= 0:
                raise TimeoutError
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except (TimeoutError, Exception):
            task.cancel()
            try:
                await asyncio.wait_for(task, 5.0)
            except BaseException:  # noqa: BLE001 - a server that will not stop is let go
                pass


def _taken(future: asyncio.Future[Any]) -> None:
    """Take up a future's outcome, so one nobody waits for any more is not reported."""
    if not future.cancelled():
        future.exception()


def _connection_closed(exc: BaseException) -> bool:
    """The server's end went away: the SDK's "Connection closed" (JSON-RPC -32000), or (mcp
    1.x) anyio's closed or broken stream under it."""
    leaf = _leaf(exc)
    if isinstance(leaf, anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream):
        return True
    error = getattr(leaf, "error", None)
    return getattr(error, "code", None) == -32000


def _cursor_params(cursor: str | None) -> dict[str, Any]:
    if cursor is None:
        return {}
    from mcp import types

    return {"params": types.PaginatedRequestParams(cursor=cursor)}
