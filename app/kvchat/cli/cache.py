"""``kvchat cache``: the KV tiers' figures, garbage collection and clearing (never text)."""

from __future__ import annotations

import json

import click

from kvchat.cli.group import KvchatGroup, service, settings_from
from kvchat.units import human_bytes


@click.group(name="cache", cls=KvchatGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@click.pass_context
def cache(ctx: click.Context, as_json: bool) -> None:
    """The KV tiers: RAM (in the running app) and disk, with their counters."""
    if ctx.invoked_subcommand is not None:
        return
    with service(settings_from(ctx)) as chat:
        stats = chat.host.kv().stats()
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    remote = stats.get("remote")
    if remote is not None:  # engine openai: the server's KV, none of kvchat's tiers
        click.echo(f"OpenAI-compatible server {remote['url']}: {remote['note']}")
        return
    ram, disk, counters = stats["ram"], stats["disk"], stats["counters"]
    shared = disk["logical_bytes"] - disk["bytes"]
    click.echo(
        f"RAM   {ram['entries']} sessions, {human_bytes(ram['bytes'])} of "
        f"{human_bytes(ram['budget_bytes'])} (lives in the running app)"
    )
    click.echo(
        f"disk  {disk['snapshots']} snapshots in {disk['chunks']} chunks, "
        f"{human_bytes(disk['bytes'])} of {human_bytes(disk['budget_bytes'] or 0)}"
        + (f" ({human_bytes(shared)} saved by shared prefixes)" if shared > 0 else "")
    )
    click.echo(
        f"hits  RAM {counters['restores_ram']}, disk {counters['restores_disk']}, "
        f"misses {counters['misses']}"
    )
    click.echo(
        f"prefill avoided: {counters['tokens_restored']:,} tokens "
        f"({human_bytes(counters['bytes_restored'])} of KV restored); "
        f"{human_bytes(counters['bytes_written'])} written"
    )


@cache.command(name="gc")
@click.pass_context
def gc_cmd(ctx: click.Context) -> None:
    """Remove orphaned files and evict snapshots beyond the disk budget (never text)."""
    with service(settings_from(ctx)) as chat:
        done = chat.cache_gc()
    click.echo(
        f"removed {len(done.orphans)} orphaned files, {human_bytes(done.freed_bytes)} of unused "
        f"chunks; evicted {len(done.evicted)} snapshots over budget"
    )


@cache.command(name="clear")
@click.argument("session_ref", required=False)
@click.pass_context
def clear_cmd(ctx: click.Context, session_ref: str | None) -> None:
    """Delete the KV snapshots of SESSION, or of every session. Text is kept."""
    with service(settings_from(ctx)) as chat:
        session_id = chat.sessions.resolve(session_ref).id if session_ref else None
        count = chat.host.kv().clear(session_id)
    click.echo(f"cleared {count} snapshots; conversations are untouched")
