"""What every ``kvchat`` command shares: the error-reporting group, the model flags,
settings from flags, and the service opened and closed around a command."""

from __future__ import annotations

import errno
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from kvchat.config import Settings, load_settings
from kvchat.errors import KvchatError
from kvchat.text import one_line, visible

if TYPE_CHECKING:
    from kvchat.service.chat import ChatService

F = TypeVar("F", bound=Callable[..., Any])


# Characters json.dumps(ensure_ascii=False) leaves raw that a terminal would obey (DEL, C1).
_JSON_RAW_CONTROLS = re.compile(r"[\x7f-\x9f]")


def fail(message: str) -> NoReturn:
    """One line on stderr (without control characters), exit status 2."""
    click.echo(f"kvchat: {one_line(message)}", err=True)
    sys.exit(2)


class KvchatGroup(click.Group):
    """A command group that turns :class:`KvchatError` into one line on stderr, exit 2.

    So do the operating system's and SQLite's errors that reach it (a full disk, a file
    that cannot be read): a fault is one clear line, never a traceback.

    Commands added with :meth:`add_lazy` are imported when named (or listed by
    ``--help``): ``kvchat`` alone, the app, does not import the planner, the engine probe
    or the transfer formats before its first frame.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy: dict[str, str] = {}

    def add_lazy(self, name: str, target: str) -> None:
        """Add the command ``name``, found at ``target`` ("module:attribute") on first use."""
        self._lazy[name] = target

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self._lazy.get(cmd_name)
        if target is not None and cmd_name not in self.commands:
            import importlib

            module, _, attribute = target.partition(":")
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            # The reader of stdout stopped early (`kvchat doctor | head -1`): it has what it
            # wanted; what is left goes nowhere, quietly.
            drop_stdout()
            sys.exit(0)
        except KvchatError as exc:
            fail(str(exc))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                fail(f"the disk is full: {exc.strerror} ({exc.filename or 'writing'})")
            where = f": {exc.filename}" if exc.filename else ""
            fail(f"{exc.strerror or exc}{where}")
        except sqlite3.OperationalError as exc:
            text = str(exc)
            fail(f"the disk is full: {text}" if "full" in text else f"database error: {text}")


def drop_stdout() -> None:
    """The reader of stdout went away: what is left goes to /dev/null (no error at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def shown(text: str, stream: IO[str] | None = None) -> str:
    """``text`` as it may be written to ``stream`` (stdout by default): on a terminal,
    without escape sequences or control characters; to a file or pipe, exactly."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return visible(text) if tty else text


def to_json(value: Any, **options: Any) -> str:
    """JSON for stdout: UTF-8 text as it is, but no raw control character a terminal
    would act on (json escapes C0 controls itself; DEL and C1 are escaped here too)."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return _JSON_RAW_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def model_options(func: F) -> F:
    """Flags that override the config file and ``KVCHAT_*`` environment."""
    options = [
        click.option(
            "--model",
            "model",
            type=str,
            help="GGUF file or catalog name (default: bundled SmolLM2-135M).",
        ),
        click.option("--n-ctx", "n_ctx", type=int, help="Context length in tokens."),
        click.option(
            "--threads",
            "n_threads",
            type=int,
            help="CPU threads (default: the fastest count measured on this machine).",
        ),
        click.option(
            "--repack/--no-repack",
            "repack",
            default=None,
            help="llama.cpp's weight repacking (default: on unless it crashed here).",
        ),
        click.option(
            "--gpu-layers", "n_gpu_layers", type=int, help="Layers offloaded to the GPU (-1: all)."
        ),
        click.option(
            "--kv-type",
            "kv_type",
            type=click.Choice(["f16", "q8_0", "q4_0"]),
            help="KV cache type (K and V).",
        ),
        click.option(
            "--flash-attn/--no-flash-attn", "flash_attn", default=None, help="Flash attention."
        ),
        click.option(
            "--vram",
            "vram",
            type=str,
            help="GPU memory to plan for, e.g. 6GiB (default: NVML's free memory).",
        ),
        click.option(
            "--server",
            "server_url",
            type=str,
            metavar="URL",
            help="Run the model in this llama-server (engine llama-server), e.g. "
            "http://gpu-box:8080; see `kvchat server`.",
        ),
        click.option(
            "--openai",
            "openai_url",
            type=str,
            metavar="URL",
            help="Run the model in this OpenAI-compatible server (engine openai), e.g. "
            "http://127.0.0.1:8080/v1; its key: KVCHAT_OPENAI_API_KEY.",
        ),
        click.option(
            "--chat-template",
            "chat_template",
            type=str,
            help="Chat template: chatml, gemma, llama3, mistral, phi3 or a Jinja file "
            "(default: the model's own).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def settings_from(ctx: click.Context, **flags: Any) -> Settings:
    """Settings with this command's flags over the group's flags over env and file."""
    merged: dict[str, Any] = dict(ctx.obj or {})
    merged.update({k: v for k, v in flags.items() if v is not None})
    if isinstance(merged.get("repack"), bool):
        merged["repack"] = "on" if merged["repack"] else "off"
    kv_type = merged.pop("kv_type", None)
    if kv_type:
        merged.setdefault("type_k", kv_type)
        merged.setdefault("type_v", kv_type)
        if kv_type != "f16":
            merged.setdefault("flash_attn", True)
    return load_settings(**merged)


def service(settings: Settings) -> AbstractContextManager[ChatService]:
    """The conversation service for one command, closed (hot KV saved) when it ends.

    Imported here, not at the top: ``kvchat --version`` and ``kvchat models`` load no model.
    """
    from kvchat.service.chat import open_service

    return open_service(settings)
