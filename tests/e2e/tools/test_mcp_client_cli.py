"""``kvchat tools list / call / import`` as a user runs them: the `kvchat` command (in the
test's process, as ``run_cli_here`` runs it; a process where a read must be cut by its
time cap), kvchat's config file, the SDK's server (tests/mcp_server.py) over stdio."""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
from pathlib import Path

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from tests.conftest import REPO, run_cli, run_cli_here
from tests.faults.hostile_http import is_one_clean_line
from tests.mcp_server import TOKENS_TEXT

SERVER = str(REPO / "tests" / "mcp_server.py")


def write_config(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    path.write_text(text)
    return path


def notes_server(enabled: bool = True) -> str:
    return (
        "[mcp.servers.notes]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = [{json.dumps(SERVER)}]\n"
        f"enabled = {'true' if enabled else 'false'}\n"
    )


def one_line_failure(result) -> str:
    assert result.returncode == 2 and result.stdout == "", result
    line = result.stderr.rstrip("\n")
    assert line.startswith("kvchat: ") and is_one_clean_line(line), result.stderr
    return line.removeprefix("kvchat: ")


def test_list_shows_servers_state_and_tools(tmp_path: Path):
    home = tmp_path / "home"
    write_config(
        home,
        notes_server()
        + '[mcp.servers.missing]\ncommand = "/nonexistent/mcp-server"\n'
        + '[mcp.servers.later]\ncommand = "/nonexistent/too"\nenabled = false\n'
        + '[mcp.servers."bad.name"]\ncommand = "x"\n'
        + '[mcp.servers.both]\ncommand = "x"\nurl = "http://127.0.0.1:1/"\n',
    )
    listed = run_cli_here(home, "tools", "list", "--json").json
    servers = {row["name"]: row for row in listed["servers"]}
    assert set(servers) == {"notes", "missing", "later", "server4", "both"}
    notes = servers["notes"]
    assert (notes["status"], notes["transport"], notes["enabled"], notes["error"]) == (
        "running",
        "stdio",
        True,
        None,
    )
    add = next(tool for tool in notes["tools"] if tool["name"] == "notes.add")
    assert add["description"] == "Add two integers."
    assert set(add["input_schema"]["properties"]) == {"a", "b"}
    assert servers["missing"]["status"] == "failed"
    assert servers["missing"]["error"] == (
        "server missing could not start: no such command (/nonexistent/mcp-server)"
    )
    assert (servers["later"]["status"], servers["later"]["tools"]) == ("off", [])
    assert servers["server4"]["status"] == "invalid"
    assert "letters, digits" in servers["server4"]["error"]
    assert (
        servers["both"]["error"] == "give either command (a stdio server) or url (an HTTP server)"
    )

    text = run_cli_here(home, "tools", "list").stdout
    assert "notes  stdio  running  8 tools" in text
    assert "  notes.add  Add two integers." in text
    assert "later  stdio  off" in text


def test_list_with_no_servers_says_how_to_add_one(tmp_path: Path):
    result = run_cli_here(tmp_path / "home", "tools", "list")
    assert result.stdout.startswith("no MCP servers configured: add [mcp.servers.NAME] to ")


def test_call_prints_the_whole_result_and_each_failure_is_one_line(tmp_path: Path):
    home = tmp_path / "home"
    write_config(home, notes_server() + '[mcp.servers.later]\ncommand = "x"\nenabled = false\n')
    assert run_cli_here(home, "tools", "call", "notes.add", '{"a": 2, "b": 40}').stdout == "42\n"
    assert run_cli_here(home, "tools", "call", "notes.tokens").stdout == TOKENS_TEXT + "\n"
    huge = run_cli_here(home, "tools", "call", "notes.huge", '{"mib": 1}')
    assert len(huge.stdout) == 1024 * 1024 + 1
    assert huge.stderr == "kvchat: a model would read the first 16,125 characters\n"

    error = run_cli_here(home, "tools", "call", "notes.read_note", '{"name": "x"}', check=False)
    assert error.returncode == 1 and "no note named 'x'" in error.stdout

    failures = {
        ("notes.hang", "{}", "--timeout", "1"): "notes.hang gave no result within 1 s",
        ("notes.add", '{"a": NaN}'): "the arguments of notes.add are not JSON: "
        "NaN is not a JSON number",
        ("notes.add", "[1, 2]"): "the arguments of notes.add must be a JSON object",
        ("notes.nope", "{}"): "server notes offers no tool nope (it offers: add, read_note, "
        "whoami, hang, die, huge, tokens, fail)",
        ("later.x", "{}"): "server later is not enabled",
        ("ghost.x", "{}"): "no MCP server named ghost (servers: later, notes)",
        ("noserver", "{}"): "name a tool as SERVER.TOOL, not noserver",
    }
    for args, line in failures.items():
        assert one_line_failure(run_cli_here(home, "tools", "call", *args, check=False)) == line


def test_call_with_a_session_stores_the_result_in_the_conversation(tmp_path: Path, kvhome: Path):
    write_config(kvhome, notes_server())
    service = ChatService(Settings())
    session = service.sessions.new_session("tools from the shell")
    service.close()

    result = run_cli_here(kvhome, "tools", "call", "notes.tokens", "--session", session.id)
    assert result.stdout == TOKENS_TEXT + "\n"
    assert result.stderr.startswith("kvchat: notes.tokens: done in ")
    assert f"kvchat: stored in session {session.id} as message " in result.stderr

    service = ChatService(Settings())
    try:
        (message,) = service.sessions.messages(session.id)
        assert (message.role, message.content) == ("tool", TOKENS_TEXT)
        (record,) = service.tools.records([message]).values()
        assert (record.name, record.full_text, record.is_error) == (
            "notes.tokens",
            TOKENS_TEXT,
            False,
        )
    finally:
        service.close()
    missing = run_cli_here(
        kvhome, "tools", "call", "notes.add", "{}", "--session", "nope", check=False
    )
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_import_adds_claude_and_vscode_servers_to_the_config(tmp_path: Path):
    home = tmp_path / "home"
    claude = tmp_path / "claude_desktop_config.json"
    claude.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "notes": {"command": sys.executable, "args": [SERVER]},
                    "my.files": {
                        "command": "npx",
                        "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                        "env": {"TOKEN": '${input:token} "quoted"\\ \x7f'},
                    },
                    "old": {"type": "sse", "url": "http://127.0.0.1:1/sse"},
                    "broken": {"command": 5},
                }
            }
        )
    )
    result = run_cli_here(home, "tools", "import", str(claude))
    config = home / "config.toml"
    assert (
        result.stdout
        == f"added 2 to {config} (off: set enabled = true for each to use it): notes, my-files\n"
    )
    assert result.stderr.splitlines() == [
        "kvchat: my.files is named my-files here",
        "kvchat: my-files: it uses ${...} variables, which kvchat does not fill",
        "kvchat: old: its type sse is not one kvchat speaks (stdio, http), left out",
        "kvchat: broken: command: Input should be a valid string, left out",
    ]
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    servers = tomllib.loads(config.read_text())["mcp"]["servers"]
    assert servers["my-files"]["env"] == {"TOKEN": '${input:token} "quoted"\\ \x7f'}
    assert servers["notes"] == {"command": sys.executable, "args": [SERVER], "enabled": False}
    listed = run_cli_here(home, "tools", "list", "--json").json["servers"]
    assert [(row["name"], row["status"]) for row in listed] == [
        ("my-files", "off"),
        ("notes", "off"),
    ]

    vscode = tmp_path / "mcp.json"
    vscode.write_text(
        json.dumps(
            {
                "servers": {
                    "notes": {"type": "stdio", "command": "other"},
                    "web": {"type": "http", "url": "http://127.0.0.1:9/mcp", "headers": {"A": "b"}},
                }
            }
        )
    )
    again = run_cli_here(home, "tools", "import", str(vscode), "--enable")
    assert again.stdout.splitlines() == [
        f"already in {config}, left as they are: notes",
        f"added 1 to {config} (on): web",
    ]
    servers = tomllib.loads(config.read_text())["mcp"]["servers"]
    assert servers["notes"]["command"] == sys.executable  # not replaced
    assert servers["web"] == {
        "url": "http://127.0.0.1:9/mcp",
        "enabled": True,
        "headers": {"A": "b"},
    }


def test_import_of_a_file_that_is_not_an_mcp_config_is_one_line_and_writes_nothing(
    tmp_path: Path,
):
    home = tmp_path / "home"
    cases = {
        "not.json": b"{mcpServers:",
        "list.json": b"[1, 2]",
        "none.json": b'{"other": {}}',
        "nan.json": b'{"mcpServers": {"a": {"command": "x", "timeout": NaN}}}',
        "latin1.json": b'{"mcpServers": {"\xe9": {}}}',
        "big.json": b'{"mcpServers": {}, "pad": "' + b"x" * (1024 * 1024) + b'"}',
        "deep.json": b'{"mcpServers": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        line = one_line_failure(run_cli_here(home, "tools", "import", str(path), check=False))
        assert str(path) in line or name in line, line
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # nobody writes: a plain open would wait forever
    line = one_line_failure(run_cli(home, "tools", "import", str(fifo), check=False, timeout=60))
    assert line == f"{fifo} is not a regular file"
    missing = run_cli_here(home, "tools", "import", str(tmp_path / "absent.json"), check=False)
    assert missing.returncode == 2 and is_one_clean_line(missing.stderr.rstrip("\n"))
    assert not (home / "config.toml").exists()

    write_config(home, "[mcp]\nservers = { a = { command = 'x' } }\n")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"mcpServers": {"b": {"command": "y"}}}))
    refused = one_line_failure(run_cli_here(home, "tools", "import", str(good), check=False))
    assert refused.startswith("the config would not read back")
    assert (home / "config.toml").read_text() == "[mcp]\nservers = { a = { command = 'x' } }\n"


def test_a_server_sending_bad_json_leaves_stderr_quiet(tmp_path: Path):
    """The SDK logs such faults with tracebacks; kvchat shows its one line, nothing else."""
    from tests.e2e.tools.test_mcp_client import BadJsonAfterStart
    from tests.faults.hostile_http import LocalServer

    server = LocalServer(BadJsonAfterStart)
    try:
        home = tmp_path / "home"
        write_config(home, f'[mcp.servers.bad]\nurl = "{server.url}/mcp"\ntimeout_s = 5\n')
        listed = run_cli_here(home, "tools", "list")
        assert listed.stderr == "" and "bad  http  running  1 tools" in listed.stdout
        line = one_line_failure(run_cli_here(home, "tools", "call", "bad.echo", "{}", check=False))
        # mcp 2 fails the call at once; mcp 1.x drops the bad answer and the cap ends it.
        assert line.startswith(("bad.echo failed: ", "bad.echo gave no result within 5 s"))
        write_config(
            home, f'[mcp.servers.worse]\nurl = "{server.url}/broken-start"\ntimeout_s = 5\n'
        )
        listed = run_cli_here(home, "tools", "list")
        assert listed.stderr == ""
        assert "server worse could not start: " in listed.stdout or (
            "server worse did not start and list its tools within 5 s" in listed.stdout  # 1.x
        )
    finally:
        server.close()


def test_config_names_the_servers_and_never_prints_their_env_or_headers(tmp_path: Path):
    home = tmp_path / "home"
    write_config(
        home,
        '[mcp.servers.files]\ncommand = "x"\nenv = { TOKEN = "secret-env-value" }\n'
        '[mcp.servers.web]\nurl = "http://127.0.0.1:1/mcp"\nenabled = false\n'
        'headers = { Authorization = "Bearer secret-header-value" }\n',
    )
    shown = run_cli_here(home, "config", "--json")
    assert shown.json["settings"]["mcp"]["value"] == "files, web (off) (kvchat tools list)"
    text = run_cli_here(home, "config").stdout
    assert "files, web (off) (kvchat tools list)" in text
    for output in (shown.stdout, text):
        assert "secret-env-value" not in output and "secret-header-value" not in output
    assert (
        run_cli_here(tmp_path / "empty", "config", "--json").json["settings"]["mcp"]["value"]
        == "none"
    )
