"""The MCP client against real servers: the SDK's own server class (tests/mcp_server.py)
over stdio and over streamable HTTP, and every limit: a hang, a death mid-call, a 10 MiB
result, control-token look-alikes, a command that does not exist, a server that crashes
before it speaks, bad JSON over HTTP, a server started only when enabled and stopped on
close."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import McpServerConfig
from kvchat.tools import (
    ServerGoneError,
    ToolBox,
    ToolError,
    ToolSpec,
    ToolTimeoutError,
    UnknownToolError,
)
from kvchat.tools.client import IDLE_CHECK_S
from kvchat.tools.parse import RESULT_CAP_CHARS
from tests.conftest import REPO
from tests.faults.hostile_http import LocalServer, RawHandler, is_one_clean_line
from tests.mcp_server import NOTES, TOKENS_TEXT

SERVER = str(REPO / "tests" / "mcp_server.py")
MIB = 1024 * 1024


def stdio(**options: Any) -> McpServerConfig:
    return McpServerConfig(command=sys.executable, args=[SERVER], timeout_s=30, **options)


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (and been reaped) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def one_line_error(exc: BaseException) -> str:
    text = str(exc)
    assert is_one_clean_line(text), text
    return text


@pytest.fixture(scope="module")
def box() -> Iterator[ToolBox]:
    toolbox = ToolBox({"notes": stdio()})
    yield toolbox
    toolbox.close()


def test_tools_are_listed_typed_and_called(box: ToolBox):
    tools = {spec.qualified: spec for spec in box.tools()}
    assert {"notes.add", "notes.read_note", "notes.hang", "notes.die", "notes.huge"} <= set(tools)
    add = tools["notes.add"]
    assert isinstance(add, ToolSpec) and add.server == "notes" and add.name == "add"
    assert add.description == "Add two integers."
    assert add.input_schema["type"] == "object"
    assert set(add.input_schema["properties"]) == {"a", "b"}
    (state,) = box.servers()
    assert (state.name, state.transport, state.status, state.error) == (
        "notes",
        "stdio",
        "running",
        None,
    )
    assert state.tools == len(tools) and state.approve == "ask"

    result = box.call("notes.add", {"a": 2, "b": 40}, timeout_s=10)
    assert (result.text, result.full_text, result.is_error, result.truncated) == (
        "42",
        "42",
        False,
        False,
    )
    assert 0 < result.seconds < 10
    assert box.call("notes.read_note", {"name": "groceries"}).text == NOTES["groceries"]


def test_a_tool_error_is_a_result_and_a_bad_name_one_line(box: ToolBox):
    result = box.call("notes.read_note", {"name": "nothing"})
    assert result.is_error and "nothing" in result.full_text
    with pytest.raises(UnknownToolError) as missing:
        box.call("notes.nope", {})
    assert "offers no tool nope" in one_line_error(missing.value)
    with pytest.raises(ToolError) as unqualified:
        box.call("add", {})
    assert "SERVER.TOOL" in one_line_error(unqualified.value)
    with pytest.raises(ToolError) as not_object:
        box.call("notes.add", [1, 2])  # type: ignore[arg-type]
    assert "JSON object" in one_line_error(not_object.value)


def test_a_hanging_tool_times_out_in_one_line_and_the_server_goes_on(box: ToolBox):
    began = time.monotonic()
    with pytest.raises(ToolTimeoutError) as hung:
        box.call("notes.hang", {}, timeout_s=1.0)
    took = time.monotonic() - began
    assert one_line_error(hung.value) == "notes.hang gave no result within 1 s"
    assert 1.0 <= took < 5.0
    assert box.call("notes.add", {"a": 1, "b": 1}).text == "2"
    assert box.servers()[0].status == "running"


def test_a_server_that_dies_mid_call_is_one_line_and_restarted_at_the_next_call(box: ToolBox):
    first = int(box.call("notes.whoami", {}).text)
    began = time.monotonic()
    with pytest.raises(ServerGoneError) as died:
        box.call("notes.die", {}, timeout_s=20)
    assert time.monotonic() - began < 5.0  # seen as it happened, not at the time cap
    assert one_line_error(died.value).startswith("server notes ended during notes.die")
    (state,) = box.servers()
    assert state.status == "failed" and state.error == str(died.value)
    assert gone(first)
    second = int(box.call("notes.whoami", {}).text)
    assert second != first and box.servers()[0].status == "running"


def test_a_server_that_exited_between_calls_is_started_again_for_the_next(box: ToolBox):
    first = int(box.call("notes.whoami", {}).text)
    os.kill(first, signal.SIGKILL)

    time.sleep(IDLE_CHECK_S + 0.2)  # idle long enough to be asked first
    assert box.call("notes.add", {"a": 2, "b": 2}).text == "4"  # the call itself runs
    second = int(box.call("notes.whoami", {}).text)
    assert second != first and box.servers()[0].status == "running"


def test_a_10_mib_result_is_cut_for_the_model_with_a_note_and_kept_whole(box: ToolBox):
    result = box.call("notes.huge", {"mib": 10}, timeout_s=60)
    assert len(result.full_text) == 10 * MIB
    assert result.full_text.startswith("0123456789abcdef") and not result.is_error
    assert result.truncated
    assert result.text.startswith(result.full_text[:RESULT_CAP_CHARS])
    note = result.text[RESULT_CAP_CHARS:]
    assert note == (
        f"\n[kvchat: result truncated: the first {RESULT_CAP_CHARS:,} of {10 * MIB:,} "
        "characters are shown; the whole result is kept in the conversation]"
    )
    small = box.call("notes.huge", {"mib": 1}, result_cap_chars=100)
    assert small.text.startswith(small.full_text[:100]) and len(small.full_text) == MIB


def test_control_token_look_alikes_stay_text(box: ToolBox, kvhome: Path):
    result = box.call("notes.tokens", {})
    assert result.text == result.full_text == TOKENS_TEXT

    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from tests.e2e.text.test_text_stays_text import control_ids

    service = ChatService(Settings(temperature=0.0, max_tokens=8, n_ctx=1024))
    try:
        engine = service.engine
        controls = control_ids(engine)
        assert not [t for t in engine.tokenize(result.text) if t in controls]
        plain = engine.chat_tokens([{"role": "user", "content": "result:"}])
        carried = engine.chat_tokens([{"role": "user", "content": "result:" + result.text}])
        # Only the template's own markup is control tokens; the result's look-alikes are text.
        assert [t for t in carried if t in controls] == [t for t in plain if t in controls]
        assert len(carried) > len(plain) + 10
    finally:
        service.close()


def test_a_missing_command_and_a_crash_at_start_are_one_line_each():
    with ToolBox(
        {
            "missing": McpServerConfig(command="/nonexistent/kvchat-mcp-server"),
            "crash": stdio(env={"MCP_TEST_MODE": "crash"}),
        }
    ) as toolbox:
        assert toolbox.tools() == []
        states = {state.name: state for state in toolbox.servers()}
        assert states["missing"].status == "failed"
        assert states["missing"].error == (
            "server missing could not start: no such command (/nonexistent/kvchat-mcp-server)"
        )
        assert states["crash"].status == "failed"
        assert "crashing before a word, as asked" in one_line_error(
            ToolError(states["crash"].error)
        )
        with pytest.raises(ServerGoneError) as failed:
            toolbox.call("missing.anything", {})
        assert "no such command" in one_line_error(failed.value)


def test_a_server_starts_only_when_enabled_and_close_stops_every_process(tmp_path: Path):
    marker = tmp_path / "started"
    would_start = McpServerConfig(
        command=sys.executable,
        args=["-c", f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')"],
        enabled=False,
        timeout_s=5,
    )
    toolbox = ToolBox({"notes": stdio(), "later": would_start})
    assert {state.name: state.status for state in toolbox.servers()} == {
        "notes": "idle",
        "later": "off",
    }
    assert "later.x" not in {spec.qualified for spec in toolbox.tools()}
    with pytest.raises(ToolError) as off:
        toolbox.call("later.x", {})
    assert one_line_error(off.value) == "server later is not enabled"
    pid = int(toolbox.call("notes.whoami", {}).text)
    assert not marker.exists()  # never started while off

    toolbox.set_enabled("later", True)
    toolbox.start()  # now it is started (and fails: it speaks no MCP)
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    assert {state.name: state.status for state in toolbox.servers()}["later"] == "failed"

    toolbox.close()
    assert gone(pid)
    assert {state.status for state in toolbox.servers()} <= {"stopped", "failed"}
    with pytest.raises(ToolError):
        toolbox.call("notes.add", {"a": 1, "b": 2})
    toolbox.close()  # twice is fine


# --- streamable HTTP ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()  # its hang tool's thread would hold a graceful stop
        process.wait()


def test_a_streamable_http_server_lists_calls_and_times_out(http_url: str):
    with ToolBox({"web": McpServerConfig(url=http_url, timeout_s=30)}) as toolbox:
        assert "web.add" in {spec.qualified for spec in toolbox.tools()}
        assert toolbox.servers()[0].transport == "http"
        assert toolbox.call("web.add", {"a": 20, "b": 22}).text == "42"
        assert toolbox.call("web.tokens", {}).text == TOKENS_TEXT
        with pytest.raises(ToolTimeoutError):
            toolbox.call("web.hang", {}, timeout_s=1.0)
        result = toolbox.call("web.huge", {"mib": 10}, timeout_s=60)
        assert len(result.full_text) == 10 * MIB and result.truncated


def test_an_http_url_with_no_server_is_one_line():
    port = free_port()
    with ToolBox({"web": McpServerConfig(url=f"http://127.0.0.1:{port}/mcp")}) as toolbox:
        (state,) = toolbox.start()
        assert state.status == "failed"
        assert one_line_error(ToolError(state.error)).startswith("server web could not start")


class BadJsonAfterStart(RawHandler):
    """A streamable-HTTP MCP server that starts properly, then answers a call with bytes
    that are not JSON (``/broken-start``: answers even ``initialize`` that way)."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        method = body.get("method")
        if "id" not in body:
            self.raw(202, b"")
        elif self.path == "/broken-start" or method == "tools/call":
            self.raw(200, b'{"jsonrpc": "2.0", "id": ' + str(body["id"]).encode() + b', "res')
        elif method == "initialize":
            self.reply(
                body,
                {
                    "protocolVersion": body["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "bad", "version": "1"},
                },
            )
        elif method == "tools/list":
            self.reply(body, {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]})
        else:
            self.reply(body, {})

    def do_GET(self) -> None:
        self.raw(405, b"")

    def do_DELETE(self) -> None:
        self.raw(200, b"")

    def reply(self, request: dict[str, Any], result: dict[str, Any]) -> None:
        self.raw(
            200, json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}).encode()
        )


def test_bad_json_from_an_http_server_is_one_line_never_a_hang():
    server = LocalServer(BadJsonAfterStart)
    try:
        config = McpServerConfig(url=server.url + "/mcp", timeout_s=5)
        broken = McpServerConfig(url=server.url + "/broken-start", timeout_s=5)
        with ToolBox({"bad": config, "worse": broken}) as toolbox:
            began = time.monotonic()
            assert [spec.qualified for spec in toolbox.tools()] == ["bad.echo"]
            states = {state.name: state for state in toolbox.servers()}
            assert states["worse"].status == "failed"
            one_line_error(ToolError(states["worse"].error))
            with pytest.raises(ToolError) as failed:
                toolbox.call("bad.echo", {"text": "hi"})
            one_line_error(failed.value)
            assert time.monotonic() - began < 12.0
    finally:
        server.close()


def test_servers_that_never_speak_time_out_side_by_side_and_are_ended(tmp_path: Path):
    def silent(name: str) -> McpServerConfig:
        pid_file = tmp_path / f"{name}.pid"
        script = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(120)"
        return McpServerConfig(command=sys.executable, args=["-c", script], timeout_s=3)

    with ToolBox({"slow": silent("slow"), "slower": silent("slower")}) as toolbox:
        began = time.monotonic()
        states = {state.name: state for state in toolbox.start()}
        took = time.monotonic() - began
        assert states["slow"].error == "server slow did not start and list its tools within 3 s"
        assert states["slower"].status == "failed"
        # Both at once: one cap and the SDK's 2 s wait before it ends a process, not two.
        assert 3.0 <= took < 8.0, took
        pids = [int((tmp_path / f"{name}.pid").read_text()) for name in ("slow", "slower")]
        assert all(gone(pid) for pid in pids)  # ended when their start was given up


def test_close_during_a_start_ends_the_server_and_answers_its_caller(tmp_path: Path):
    pid_file = tmp_path / "silent.pid"
    script = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(120)"
    toolbox = ToolBox(
        {"silent": McpServerConfig(command=sys.executable, args=["-c", script], timeout_s=60)}
    )
    answered: list[Any] = []
    starter = threading.Thread(target=lambda: answered.append(toolbox.tools()))
    starter.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    began = time.monotonic()
    toolbox.close()  # the app quits while a server is still starting
    starter.join(15)
    assert not starter.is_alive() and answered == [[]]
    assert time.monotonic() - began < 10  # not the start's 60 s cap
    assert gone(int(pid_file.read_text()))
    (state,) = toolbox.servers()
    assert state.status == "failed" and state.error == "the tool box was closed meanwhile"
