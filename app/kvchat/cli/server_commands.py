"""``kvchat server``: the llama-server command line for the llama-server engine; start, build."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import click

from kvchat.cli.group import KvchatGroup, model_options, settings_from
from kvchat.errors import KvchatError


def _server_options(func: Any) -> Any:
    options = [
        click.option(
            "--host", default="127.0.0.1", show_default=True, help="Address to listen on."
        ),
        click.option("--port", default=8080, show_default=True, type=int, help="Port."),
        click.option(
            "--slots",
            default=4,
            show_default=True,
            type=int,
            help="Slots (-np): sessions kept hot at once.",
        ),
        click.option(
            "--slot-dir",
            type=click.Path(path_type=Path, file_okay=False),
            help="Where the server saves slot files (default: kvchat's data dir).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _plan(ctx: click.Context, flags: dict[str, Any]) -> Any:
    from kvchat.engine.server_build import plan_server

    host, port, slots, slot_dir = (flags.pop(k) for k in ("host", "port", "slots", "slot_dir"))
    settings = settings_from(ctx, **flags)
    return plan_server(settings, host=host, port=port, slots=slots, slot_dir=slot_dir)


@click.group(name="server", cls=KvchatGroup, invoke_without_command=True)
@_server_options
@model_options
@click.pass_context
def server(ctx: click.Context, **flags: Any) -> None:
    """Print the llama-server command line for the llama-server engine.

    Run it on the machine with the model (or `kvchat server start` there), then chat
    from anywhere with `kvchat --server http://HOST:PORT`. Each slot keeps one session
    hot; every session's KV is saved to a slot file on the server after each turn.
    """
    if ctx.invoked_subcommand is not None:
        return
    plan = _plan(ctx, flags)
    click.echo(shlex.join(plan.argv()))
    click.echo(f"# then: kvchat --server {plan.url}", err=True)


@server.command(name="start")
@_server_options
@model_options
@click.pass_context
def start_cmd(ctx: click.Context, **flags: Any) -> None:
    """Run that llama-server here (the binary `kvchat server build` made), supervised.

    When llama-server dies (a crash, a kill) it is started again after a pause that grows
    with each restart in a row; the log says why it died and which slot file it had open.
    kvchat on this machine checks each slot file's size and checksum before a restore.
    """
    from kvchat.engine.server_build import find_binary, prepare_slot_dir
    from kvchat.engine.server_registry import LocalServer
    from kvchat.engine.server_supervisor import Supervisor

    threads = flags.get("n_threads")
    plan = _plan(ctx, flags)
    if find_binary() is None:
        raise KvchatError("no llama-server binary: run `kvchat server build` first")
    slot_dir = prepare_slot_dir(plan.slot_dir).resolve()
    argv = plan.argv()
    if threads is not None:
        argv += ["--threads", str(threads)]
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    say(f"kvchat: {shlex.join(argv)}")
    say(f"kvchat: chat with `kvchat --server {plan.url}`")
    entry = LocalServer(
        port=plan.port,
        slot_dir=str(slot_dir),
        model_path=str(plan.model),
        pid=os.getpid(),
        url=plan.url,
    )
    raise SystemExit(Supervisor(argv, entry, say=say).run())


@server.command(name="build")
@click.option("--jobs", type=int, help="Parallel compile jobs (default: every CPU).")
@click.option(
    "--sdist",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Use this llama-cpp-python sdist instead of downloading it.",
)
@click.option(
    "--from-binary",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Install an already built llama-server binary into the cache.",
)
def build_cmd(jobs: int | None, sdist: Path | None, from_binary: Path | None) -> None:
    """Build llama-server from the installed llama-cpp-python's sdist (downloads it from
    PyPI with pip) into the user cache; the llama-server engine's tests use it too."""
    from kvchat.engine.server_build import build_binary, install_binary

    if from_binary is not None:
        path = install_binary(from_binary)
    else:
        path = build_binary(jobs=jobs, source=sdist, say=lambda line: click.echo(line, err=True))
    click.echo(str(path))
