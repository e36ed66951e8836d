"""``kvchat tools import FILE``: the MCP servers of another app's config, into kvchat's.

Read: Claude Desktop's ``{"mcpServers": {NAME: {command, args, env}}}``, VS Code's
``{"servers": {NAME: {type, command, args, env | url, headers}}}`` (``.vscode/mcp.json``)
and its settings' ``{"mcp": {"servers": …}}``. The file is outside kvchat: read once, bounded,
and every entry checked as kvchat's own config checks it; one that cannot be taken is one
line, the rest go on. Written: one ``[mcp.servers.NAME]`` table per new server, appended to
kvchat's config file (a temporary file, then a rename; the result is read back as TOML first).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvchat.config import MCP_MAX_SERVERS, McpServerConfig
from kvchat.config_file import write_config_text
from kvchat.text import one_line
from kvchat.tools.api import ToolError
from kvchat.tools.parse import quoted

MAX_IMPORT_BYTES = 1024 * 1024
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_VARIABLE = re.compile(r"\$\{[^}]*\}")


@dataclass
class ImportPlan:
    """What a file offers: servers by (kvchat-safe) name, and a line per entry left out or
    changed."""

    servers: dict[str, McpServerConfig] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def shown(path: Path) -> str:
    """The path the user named, whole (its end says which file), as one visible line."""
    return one_line(str(path))


def safe_name(name: str) -> str:
    """A server name as kvchat takes it: letters, digits, - and _ (a dot would split
    ``server.tool``), at most 64."""
    return _NAME_UNSAFE.sub("-", name).strip("-")[:64]


def _entry(raw: Mapping[str, Any], enabled: bool) -> dict[str, Any]:
    """One foreign entry in kvchat's field names."""
    kind = raw.get("type")
    if kind not in (None, "stdio", "http", "streamable-http", "streamableHttp"):
        raise ValueError(f"its type {quoted(kind)} is not one kvchat speaks (stdio, http)")
    entry: dict[str, Any] = {"enabled": enabled}
    for key in ("command", "args", "env", "url", "headers"):
        if key in raw:
            entry[key] = raw[key]
    return entry


def read_mcp_json(path: Path, *, enabled: bool = False) -> ImportPlan:
    """The servers of ``path`` (see the module's docstring), or a ToolError for a file that
    cannot be read at all."""
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise ToolError(f"{shown(path)} is not a regular file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_IMPORT_BYTES + 1)
    except OSError as exc:
        raise ToolError(f"cannot read {shown(path)}: {exc.strerror or exc}") from None
    if len(data) > MAX_IMPORT_BYTES:
        raise ToolError(f"{shown(path)} is over {MAX_IMPORT_BYTES:,} bytes: not an MCP config")
    try:
        document = json.loads(data.decode("utf-8-sig"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ToolError(f"{shown(path)} is not JSON: {quoted(exc)}") from None
    if not isinstance(document, dict):
        raise ToolError(f"{shown(path)} holds no mcpServers or servers object")
    table = document.get("mcpServers")
    if table is None:
        table = document.get("servers")
    if table is None and isinstance(document.get("mcp"), dict):
        table = document["mcp"].get("servers")
    if not isinstance(table, dict):
        raise ToolError(f"{shown(path)} holds no mcpServers or servers object")
    plan = ImportPlan()
    for index, (name, raw) in enumerate(table.items()):
        if len(plan.servers) >= MCP_MAX_SERVERS:
            plan.notes.append(f"more than {MCP_MAX_SERVERS} servers: the rest are left out")
            break
        label = safe_name(name)
        if not label:
            plan.notes.append(f"server {index + 1} ({quoted(name)}): no usable name, left out")
            continue
        if label in plan.servers:
            plan.notes.append(f"{quoted(name)}: a second server named {label}, left out")
            continue
        if not isinstance(raw, dict):
            plan.notes.append(f"{label}: not an object, left out")
            continue
        try:
            config = McpServerConfig.model_validate(_entry(raw, enabled))
        except (ValueError, ValidationError) as exc:
            plan.notes.append(f"{label}: {_why(exc)}, left out")
            continue
        if label != name:
            plan.notes.append(f"{quoted(name)} is named {label} here")
        texts = [config.command or "", config.url or "", *config.args, *config.env.values()]
        if any(_VARIABLE.search(text) for text in [*texts, *config.headers.values()]):
            plan.notes.append(f"{label}: it uses ${{...}} variables, which kvchat does not fill")
        plan.servers[label] = config
    return plan


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _why(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return quoted(f"{where}: {message}" if where else message)
    return quoted(exc)


# --- writing TOML --------------------------------------------------------------------------


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are TOML's; DEL is escaped too)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_table(name: str, config: McpServerConfig) -> str:
    """One ``[mcp.servers.NAME]`` table (fields left at their defaults are not written,
    but ``enabled``)."""
    lines = [f"[mcp.servers.{toml_string(name)}]"]
    if config.command is not None:
        lines.append(f"command = {toml_string(config.command)}")
        if config.args:
            lines.append(f"args = [{', '.join(toml_string(a) for a in config.args)}]")
    if config.url is not None:
        lines.append(f"url = {toml_string(config.url)}")
    lines.append(f"enabled = {'true' if config.enabled else 'false'}")
    if config.approve != "ask":
        lines.append(f"approve = {toml_string(config.approve)}")
    for key in ("env", "headers"):
        values: dict[str, str] = getattr(config, key)
        if values:
            pairs = ", ".join(f"{toml_string(k)} = {toml_string(v)}" for k, v in values.items())
            lines.append(f"{key} = {{ {pairs} }}")
    return "\n".join(lines) + "\n"


def add_to_config(config_path: Path, plan: ImportPlan) -> tuple[list[str], list[str]]:
    """Append ``plan``'s servers that ``config_path`` does not name yet; (added, already
    there). The file is replaced whole (temporary file, fsync, rename), keeping its mode
    (0600 when new), and only after the new text reads back as the same servers."""
    try:
        if config_path.is_file() and config_path.stat().st_size > MAX_IMPORT_BYTES:
            raise ToolError(f"kvchat's config {quoted(config_path)} is over 1 MiB: not edited")
        old = config_path.read_text("utf-8") if config_path.is_file() else ""
        existing = tomllib.loads(old) if old else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ToolError(
            f"kvchat's config {quoted(config_path)} cannot be read: {quoted(exc)}"
        ) from None
    mcp = existing.get("mcp", {})
    present = mcp.get("servers", {}) if isinstance(mcp, dict) else {}
    if not isinstance(present, dict):
        raise ToolError(f"[mcp.servers] in {quoted(config_path)} is not a table")
    added = [name for name in plan.servers if name not in present]
    kept = [name for name in plan.servers if name in present]
    if not added:
        return added, kept
    tables = "\n".join(toml_table(name, plan.servers[name]) for name in added)
    new = old + ("\n" if old and not old.endswith("\n") else "") + ("\n" if old else "") + tables
    try:
        servers = tomllib.loads(new)["mcp"]["servers"]
        for name in added:
            if McpServerConfig.model_validate(servers[name]) != plan.servers[name]:
                raise ValueError(f"server {name} reads back changed")
    except (tomllib.TOMLDecodeError, KeyError, ValueError, ValidationError) as exc:
        raise ToolError(
            f"the config would not read back ({quoted(exc)}): nothing written"
        ) from None
    write_config_text(config_path, new)  # atomic, 0600, as the app's own settings
    return added, kept
