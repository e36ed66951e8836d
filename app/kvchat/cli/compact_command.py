"""``kvchat compact SESSION``: the model writes a summary of the session's older messages,
read instead of them from then on (see :mod:`kvchat.service.compaction`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from kvchat.cli.group import model_options, service, settings_from, to_json
from kvchat.errors import KvchatError
from kvchat.text import visible

if TYPE_CHECKING:
    from kvchat.service.compaction import CompactionPlan


@click.command(name="compact")
@click.argument("session_ref", metavar="SESSION")
@click.option(
    "--summary",
    "given",
    help="Use this summary instead of the model's (it must be shorter than what it replaces).",
)
@click.option("--dry-run", is_flag=True, help="Only say what a compaction would replace and cost.")
@click.option("--yes", "-y", is_flag=True, help="Keep the summary without asking.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@model_options
@click.pass_context
def compact(
    ctx: click.Context,
    /,
    session_ref: str,
    given: str | None,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Summarize SESSION's older messages so the conversation goes on from [system prompt,
    documents, summary, newest messages]. The messages stay (searchable, exported); the
    conversation as it was is kept as a branch. Says first how many tokens the summary
    replaces and how long the re-read takes here; nothing changes until the summary is kept.
    """
    settings = settings_from(ctx, **flags)
    with service(settings) as chat:
        session = chat.sessions.resolve(session_ref)
        plan = chat.compaction.plan(session.id)
        if not as_json:
            click.echo(plan.line(), err=True)
        if dry_run:
            if as_json:
                click.echo(to_json({"session": session.id, "plan": _plan_json(plan)}))
            return
        if given is None:
            shown = not as_json
            draft = chat.compaction.draft(
                plan,
                on_token=(lambda piece: click.echo(visible(piece), nl=False)) if shown else None,
            )
            if shown:
                click.echo()
            text = draft.text
        else:
            text = given
        chat.compaction.check(plan, text)
        if not yes:
            if not sys.stdin.isatty():
                raise KvchatError(
                    "not compacted: keep the summary with --yes (or give one with --summary)"
                )
            if not click.confirm("Keep this summary?", default=False, err=True):
                click.echo("not compacted: the conversation is as it was", err=True)
                return
        done = chat.compaction.accept(plan, text)
    if as_json:
        click.echo(
            to_json(
                {
                    "session": session.id,
                    "plan": _plan_json(plan),
                    "summary": done.summary.to_json(),
                    "branch": done.branch_id,
                    "prompt_tokens": done.prompt,
                    "decoded": done.decoded,
                    "snapshot_bytes": done.snapshot.bytes,
                    "snapshot_error": done.snapshot.error,
                }
            )
        )
    else:
        click.echo(done.line(), err=True)


def _plan_json(plan: CompactionPlan) -> dict[str, Any]:
    return {
        "upto_message_id": plan.upto_message_id,
        "covered": plan.covered,
        "kept": plan.kept,
        "replaced_tokens": plan.replaced_tokens,
        "kept_tokens": plan.kept_tokens,
        "reread_seconds": plan.reread_seconds,
    }
