"""What every ``kvchat`` command shares: the error-reporting group, the model flags,
settings from flags, and the service opened and closed around a command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvchat.config import Settings, load_settings
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.chat import ChatService

F = TypeVar("F", bound=Callable[..., Any])


class KvchatGroup(click.Group):
    """A command group that turns :class:`KvchatError` into one line on stderr, exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvchatError as exc:
            click.echo(f"kvchat: {exc}", err=True)
            sys.exit(2)


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
            "--threads", "n_threads", type=int, help="CPU threads (default: physical cores)."
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
    ]
    for option in reversed(options):
        func = option(func)
    return func


def settings_from(ctx: click.Context, **flags: Any) -> Settings:
    """Settings with this command's flags over the group's flags over env and file."""
    merged: dict[str, Any] = dict(ctx.obj or {})
    merged.update({k: v for k, v in flags.items() if v is not None})
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
    from kvchat.chat import open_service

    return open_service(settings)
