"""What an MCP server sends and what a user configures, parsed at the boundary (no server,
no process): tool lists, schemas, results, arguments, ``[mcp.servers.NAME]`` entries, another
app's MCP JSON and the TOML kvchat writes from it."""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import McpServerConfig, McpSettings
from kvchat.tools import ToolError, ToolSpec
from kvchat.tools import parse as parse_module
from kvchat.tools.importing import ImportPlan, add_to_config, read_mcp_json, safe_name, toml_table
from kvchat.tools.parse import (
    MAX_SCHEMA_BYTES,
    MAX_TOOLS_PER_SERVER,
    parse_arguments,
    parse_result,
    parse_tool,
    parse_tool_list,
    split_qualified,
)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# --- tools ----------------------------------------------------------------------------------


def test_a_tool_is_read_into_a_bounded_spec():
    spec = parse_tool(
        "notes",
        {
            "name": "add",
            "description": "  Add two integers.\n",
            "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "outputSchema": {"anything": True},
        },
    )
    assert spec == ToolSpec(
        "notes",
        "add",
        "Add two integers.",
        {"type": "object", "properties": {"a": {"type": "integer"}}},
    )
    assert spec.qualified == "notes.add"
    bare = parse_tool("s", {"name": "ping", "title": "Ping it"})
    assert bare.input_schema == {"type": "object", "properties": {}}
    assert bare.description == "Ping it"
    long = parse_tool("s", {"name": "x", "description": "d" * 10_000})
    assert len(long.description) == 4096 and long.description.endswith("…")
    odd = parse_tool("s", {"name": "x", "description": "a\ud800b"})
    assert odd.description == "a\ufffdb"
    assert parse_tool("s", {"name": "a.b-c_d"}).qualified == "s.a.b-c_d"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("add", "is not an object"),
        ({"name": "../../etc/passwd"}, "a name is 1-128 letters"),
        ({"name": "evil\x1b]0;pwned\x07"}, "a name is 1-128 letters"),
        ({"name": "a b"}, "a name is 1-128 letters"),
        ({"name": "x" * 129}, "a name is 1-128 letters"),
        ({"name": ""}, "a name is 1-128 letters"),
        ({"name": 5}, "a name is 1-128 letters"),
        ({"name": "x", "description": ["no"]}, "its description is not text"),
        ({"name": "x", "inputSchema": "object"}, "its input schema is not an object"),
        ({"name": "x", "inputSchema": {"type": "array"}}, "its input schema's type is not object"),
        ({"name": "x", "inputSchema": nested(40)}, "nested more than 16 levels deep"),
        (
            {"name": "x", "inputSchema": {"type": "object", "default": float("nan")}},
            "not plain JSON",
        ),
        (
            {"name": "x", "inputSchema": {"type": "object", "big": "x" * MAX_SCHEMA_BYTES}},
            "over the",
        ),
        ({"name": "x", "inputSchema": {"type": "object", 1: "int key"}}, None),
    ],
)
def test_a_tool_that_cannot_be_read_is_one_line(raw: Any, says: str | None):
    if says is None:  # json turns an int key into text: still plain JSON
        assert parse_tool("s", raw).input_schema["1"] == "int key"
        return
    with pytest.raises(ToolError) as refused:
        parse_tool("s", raw)
    message = str(refused.value)
    assert says in message and "\n" not in message and "\x1b" not in message


def test_a_tool_list_keeps_what_it_can_and_says_what_it_left_out():
    tools, notes = parse_tool_list(
        "s",
        [{"name": "a"}, {"name": "a"}, {"name": "bad name"}, 7, {"name": "b"}],
    )
    assert [tool.name for tool in tools] == ["a", "b"]
    assert notes[0] == "server s lists a twice; the first is kept"
    assert notes[1].endswith("(entry 3, left out)")
    assert notes[2] == "a tool of server s is not an object (entry 4, left out)"
    many, notes = parse_tool_list("s", [{"name": f"t{i}"} for i in range(1000)])
    assert len(many) == MAX_TOOLS_PER_SERVER
    assert notes == [f"server s lists 1,000 tools; kvchat takes the first {MAX_TOOLS_PER_SERVER}"]
    with pytest.raises(ToolError, match="tool list is not a list"):
        parse_tool_list("s", {"tools": []})


# --- results --------------------------------------------------------------------------------


def test_a_result_is_text_and_other_content_is_a_note():
    result = parse_result(
        {
            "content": [
                {"type": "text", "text": "one"},
                {"type": "image", "mimeType": "image/png", "data": "aGVsbG8="},
                {"type": "audio", "mimeType": "audio/wav"},
                {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "inside"}},
                {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "AAAA"}},
                {"type": "resource_link", "uri": "https://example.com/x", "name": "x"},
                {"type": "video\x1b[2J"},
                "not an object",
            ],
            "isError": False,
        },
        seconds=0.5,
    )
    assert result.full_text.split("\n") == [
        "one",
        "[kvchat: image (image/png, 8 characters of base64) not shown to the model]",
        "[kvchat: audio (audio/wav, no data) not shown to the model]",
        "[resource file:///a.txt]",
        "inside",
        "[kvchat: resource file:///b.bin (4 characters of base64) not shown]",
        "[resource link: https://example.com/x]",
        "[kvchat: a content block of type video not shown]",
        "[kvchat: a content block that is not an object, left out]",
    ]
    assert result.text == result.full_text and not result.truncated
    assert (result.is_error, result.seconds) == (False, 0.5)


def test_structured_content_alone_is_the_text_and_is_error_must_be_true():
    result = parse_result(
        {"content": [], "structuredContent": {"a": 1}, "isError": "true"}, seconds=1
    )
    assert (result.text, result.is_error) == ('{"a": 1}', False)
    assert parse_result({"isError": True}, seconds=0).is_error
    assert parse_result({"content": None}, seconds=float("nan")).seconds == 0.0
    with pytest.raises(ToolError, match="content is not a list"):
        parse_result({"content": "text"}, seconds=0)
    with pytest.raises(ToolError, match="result is not an object"):
        parse_result([1], seconds=0)


def test_a_long_result_is_cut_for_the_model_with_a_note_and_kept(monkeypatch: pytest.MonkeyPatch):
    text = "x" * 1000
    result = parse_result({"content": [{"type": "text", "text": text}]}, seconds=0, cap=100)
    assert result.full_text == text and result.truncated
    assert result.text == "x" * 100 + (
        "\n[kvchat: result truncated: the first 100 of 1,000 characters are shown; "
        "the whole result is kept in the conversation]"
    )
    exact = parse_result({"content": [{"type": "text", "text": text}]}, seconds=0, cap=1000)
    assert exact.text == text and not exact.truncated
    monkeypatch.setattr(parse_module, "FULL_CAP_CHARS", 500)
    kept = parse_result({"content": [{"type": "text", "text": text}]}, seconds=0, cap=100)
    assert kept.full_text == "x" * 500 + "\n[kvchat: cut at 500 of 1,000 characters]"


# --- arguments ------------------------------------------------------------------------------


def test_arguments_are_a_bounded_json_object():
    assert parse_arguments("s.t", '{"a": 1, "b": [true, null]}') == {"a": 1, "b": [True, None]}
    assert parse_arguments("s.t", "") == {}
    for text, says in [
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"a": -Infinity}', "-Infinity is not a JSON number"),
        ("[1]", "must be a JSON object"),
        ("{", "are not JSON"),
        ('{"a": "' + "x" * (1024 * 1024) + '"}', "are over 1,048,576 characters"),
        ("[" * 50_000 + "]" * 50_000, "are not JSON"),
        ('{"a": ' * 20 + "1" + "}" * 20, "nested more than 16 levels deep"),
    ]:
        with pytest.raises(ToolError) as refused:
            parse_arguments("s.t", text)
        assert says in str(refused.value) and "\n" not in str(refused.value)
    assert split_qualified("a.b.c") == ("a", "b.c")
    for bad in ("", "a", ".b", "a."):
        with pytest.raises(ToolError, match="SERVER.TOOL"):
            split_qualified(bad)


# --- config ---------------------------------------------------------------------------------


def test_config_entries_that_cannot_be_read_are_one_line_each_and_the_rest_stay():
    settings = McpSettings.model_validate(
        {
            "servers": {
                "ok": {"command": "python", "args": ["-m", "x"], "env": {"A": "1"}},
                "web": {"url": "https://example.com/mcp", "approve": "always"},
                "both": {"command": "x", "url": "http://y"},
                "neither": {"enabled": True},
                "ftp": {"url": "ftp://x"},
                "typo": {"comand": "x"},
                "nan": {"command": "x", "timeout_s": float("nan")},
                "slow": {"command": "x", "timeout_s": 1e9},
                "nul": {"command": "x\x00y"},
                "approve": {"command": "x", "approve": "never"},
                "has.dot": {"command": "x"},
                "list": ["x"],
            }
        }
    )
    assert set(settings.servers) == {"ok", "web"}
    assert settings.servers["web"].approve == "always" and settings.servers["ok"].enabled
    problems = settings.problems
    assert problems["both"] == "give either command (a stdio server) or url (an HTTP server)"
    assert problems["neither"] == problems["both"]
    assert problems["ftp"] == "url must start with http:// or https://"
    assert problems["typo"] == "comand: Extra inputs are not permitted"
    assert problems["nan"] == "timeout_s: Input should be a finite number"
    assert problems["slow"].startswith("timeout_s: Input should be less than or equal to 3600")
    assert "NUL" in problems["nul"]
    assert problems["approve"].startswith("approve: Input should be 'ask' or 'always'")
    assert problems["server11"].startswith("a server name must be 1-64 letters")
    assert "list" in problems
    assert all("\n" not in line for line in problems.values())
    assert McpSettings.model_validate("nope").problems == {"mcp": "[mcp] is not a table"}
    many = McpSettings.model_validate({"servers": {f"s{i}": {"command": "x"} for i in range(100)}})
    assert len(many.servers) == 64 and "more than 64" in many.problems["mcp.servers"]


# --- import ---------------------------------------------------------------------------------


def test_safe_names():
    assert safe_name("my.server") == "my-server"
    assert safe_name("../../x") == "x"
    assert safe_name("\x1b[31m") == "31m"
    assert safe_name("日本") == ""
    assert len(safe_name("a" * 200)) == 64


def test_the_toml_written_reads_back_the_same_for_any_text(tmp_path: Path):
    generator = random.Random(43)
    alphabet = [
        '"',
        "\\",
        "\n",
        "\t",
        "\r",
        "\x7f",
        "\x00",
        "\x1b",
        "é",
        "😀",
        "\u2028",
        "'",
        "a",
        "=",
        "[",
        "]",
        "#",
    ]
    for index in range(100):

        def text(n: int = 8) -> str:
            return "".join(generator.choice(alphabet) for _ in range(generator.randint(1, n)))

        config = McpServerConfig(
            command=text().replace("\x00", "") or "x",
            args=[text().replace("\x00", "") for _ in range(3)],
            env={text().replace("\x00", ""): text().replace("\x00", "")},
            enabled=bool(index % 2),
        )
        table = toml_table(f"s{index}", config)
        assert (
            McpServerConfig.model_validate(tomllib.loads(table)["mcp"]["servers"][f"s{index}"])
            == config
        )
    path = tmp_path / "config.toml"
    path.write_text('model = "x"\n# a comment kept\n[mcp.servers.old]\ncommand = "y"')
    plan = ImportPlan(
        {"old": McpServerConfig(command="z"), "new": McpServerConfig(url="http://a/")}
    )
    assert add_to_config(path, plan) == (["new"], ["old"])
    text = path.read_text()
    assert text.startswith('model = "x"\n# a comment kept\n[mcp.servers.old]\ncommand = "y"\n')
    assert tomllib.loads(text)["mcp"]["servers"]["new"] == {"url": "http://a/", "enabled": True}


def test_reading_another_apps_mcp_json(tmp_path: Path):
    path = tmp_path / "settings.json"
    path.write_text(
        json.dumps({"mcp": {"servers": {"gh": {"type": "http", "url": "https://x/mcp"}}}})
    )
    plan = read_mcp_json(path)
    assert plan.servers == {"gh": McpServerConfig(url="https://x/mcp", enabled=False)}
    path.write_bytes(b'\xef\xbb\xbf{"mcpServers": {}}')  # a BOM, as some editors write
    assert read_mcp_json(path) == ImportPlan()
