"""``kvchat tools ...``: MCP tool servers from the shell (see :mod:`kvchat.tools`).

- ``kvchat tools list [--json]``: each configured server (transport, on or off, its state or
  the line saying why it failed) and the tools of those that run; enabled servers are
  started to list them and stopped after;
- ``kvchat tools call SERVER.TOOL [JSON] [--session S] [--timeout S]``: call one tool and
  print its whole result; with ``--session`` the result also goes into that conversation as
  a tool message (typing the command is the approval);
- ``kvchat tools import FILE [--enable]``: the servers of a Claude Desktop or VS Code MCP
  config, added to kvchat's config file (off unless ``--enable``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kvchat.cli.group import KvchatGroup, service, settings_from, shown, to_json
from kvchat.paths import config_file
from kvchat.text import one_line
from kvchat.tools import ServerState, ToolBox, ToolSpec
from kvchat.tools.parse import parse_arguments


@click.group(name="tools", cls=KvchatGroup)
def tools_group() -> None:
    """MCP tool servers: list them and their tools, call one, import another app's."""


def _state_json(state: ServerState, tools: list[ToolSpec], notes: list[str]) -> dict[str, Any]:
    return {
        "name": state.name,
        "transport": state.transport,
        "target": state.target,
        "enabled": state.enabled,
        "approve": state.approve,
        "status": state.status,
        "error": state.error,
        "notes": notes,
        "tools": [
            {
                "name": spec.qualified,
                "description": spec.description,
                "input_schema": spec.input_schema,
            }
            for spec in tools
            if spec.server == state.name
        ],
    }


@tools_group.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print servers and tools as JSON.")
@click.pass_context
def list_cmd(ctx: click.Context, as_json: bool) -> None:
    """Servers from [mcp.servers.NAME], their state, and the tools of those enabled."""
    settings = settings_from(ctx)
    with ToolBox.from_settings(settings) as box:
        tools = box.tools()
        states = box.servers()
        notes = {state.name: box.notes(state.name) for state in states}
    if as_json:
        rows = [_state_json(state, tools, notes[state.name]) for state in states]
        click.echo(to_json({"config": str(config_file()), "servers": rows}, indent=2))
        return
    if not states:
        click.echo(f"no MCP servers configured: add [mcp.servers.NAME] to {config_file()}")
        click.echo("or import another app's: kvchat tools import FILE")
        return
    for state in states:
        head = f"{state.name}  {state.transport}  {state.status}"
        if state.status == "running":
            head += f"  {state.tools} tools"
        click.echo(shown(f"{head}  ({state.target})"))
        if state.error:
            click.echo(shown(f"  {one_line(state.error)}"))
        for note in notes[state.name]:
            click.echo(shown(f"  note: {one_line(note)}"))
        for spec in tools:
            if spec.server == state.name:
                summary = one_line(spec.description.split("\n")[0])[:100]
                click.echo(shown(f"  {spec.qualified}" + (f"  {summary}" if summary else "")))


@tools_group.command(name="call")
@click.argument("qualified", metavar="SERVER.TOOL")
@click.argument("arguments", metavar="[JSON]", required=False, default="{}")
@click.option("--session", "session_ref", help="Put the result into this session (id or title).")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait (default: the server's).")
@click.pass_context
def call_cmd(
    ctx: click.Context,
    qualified: str,
    arguments: str,
    session_ref: str | None,
    timeout_s: float | None,
) -> None:
    """Call one tool with JSON arguments and print its whole result (exit 1: the tool
    answered with an error)."""
    args = parse_arguments(qualified, arguments)
    settings = settings_from(ctx)
    if session_ref is None:
        with ToolBox.from_settings(settings) as box:
            result = box.call(qualified, args, timeout_s=timeout_s)
        click.echo(shown(result.full_text))
        if result.truncated:
            click.echo(
                f"kvchat: a model would read the first {len(result.text):,} characters",
                err=True,
            )
        sys.exit(1 if result.is_error else 0)
    with service(settings) as chat:
        session = chat.sessions.resolve(session_ref)
        chat.tools.attach_configured()
        chat.tools.timeout_s = timeout_s
        step = chat.tools.call_directly(session.id, qualified, args, lambda request: "once")
    if step.result is not None:
        click.echo(shown(step.result.full_text))
    click.echo(f"kvchat: {one_line(step.line)}", err=True)
    if step.message_id is not None:
        click.echo(f"kvchat: stored in session {session.id} as message {step.message_id}", err=True)
    sys.exit(0 if step.result is not None and not step.result.is_error else 1)


@tools_group.command(name="import")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--enable", is_flag=True, help="Turn the imported servers on (default: off).")
def import_cmd(path: Path, enable: bool) -> None:
    """Add the MCP servers of a Claude Desktop (mcpServers) or VS Code (servers) JSON file
    to kvchat's config file."""
    from kvchat.tools.importing import add_to_config, read_mcp_json

    plan = read_mcp_json(path, enabled=enable)
    target = config_file()
    added, kept = add_to_config(target, plan) if plan.servers else ([], [])
    for note in plan.notes:
        click.echo(shown(f"kvchat: {one_line(note)}"), err=True)
    if kept:
        click.echo(shown(f"already in {target}, left as they are: {', '.join(kept)}"))
    if not added:
        click.echo(shown(f"no servers added to {target}"))
        return
    state = "on" if enable else "off: set enabled = true for each to use it"
    click.echo(shown(f"added {len(added)} to {target} ({state}): {', '.join(added)}"))
