"""``kvchat import`` and the bundle branch of ``kvchat export`` (see kvchat.transfer)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvchat.cli.group import model_options, service, settings_from
from kvchat.errors import KvchatError
from kvchat.units import human_bytes


def _line(item: Any, carries_kv: bool) -> str:
    """One line per session: id, title, messages, and (for a bundle) what became of its KV."""
    from kvchat.text import visible

    title = visible(" ".join(item.title.split()))
    notes = [f"{item.messages} message{'' if item.messages == 1 else 's'}"]
    if item.documents:
        notes.append(f"{item.documents} document{'' if item.documents == 1 else 's'}")
    if item.skipped:
        notes.append(f"{item.skipped} left out (tool calls, images, hidden context)")
    if not item.new:
        notes.append("already imported")
    elif item.kv_tokens:
        notes.append(f"KV {item.kv_tokens:,} tokens, {_made_elsewhere(item)}")
    elif carries_kv:
        notes.append(f"text only: {visible(item.kv_reason or 'no KV')}")
    return f"{item.session}  {title}  ({'; '.join(notes)})"


def _made_elsewhere(item: Any) -> str:
    """What taking a bundle's KV means, and what its check cost."""
    check = item.kv_check
    checked = (
        f"its first {check.tokens:,} tokens recomputed here and matched in {check.ms:.0f} ms"
        if check is not None
        else "not recomputed here"
    )
    return (
        f"made elsewhere: trusted like a snapshot of this session only, never shared with "
        f"others ({checked}; --no-kv takes the text alone)"
    )


class _ImportProgress:
    """How far an import has got, on stderr: a bar redrawn on a terminal (at most 10 times a
    second), else a line every :data:`PROGRESS_EVERY` conversations."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream = stream
        self.path = path
        self.tty = stream.isatty()
        self.last = 0.0
        self.drawn = False

    def __call__(self, progress: Any) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self.last < 0.1:
                return
            self.last = now
            share = progress.bytes_done / progress.bytes_total if progress.bytes_total else 1.0
            filled = int(share * BAR_WIDTH)
            bar = "█" * filled + "░" * (BAR_WIDTH - filled)
            self.stream.write(
                f"\r{bar} {share:4.0%}  {progress.sessions:,} conversations,"
                f" {progress.messages:,} messages\x1b[K"
            )
            self.drawn = True
        elif progress.sessions % PROGRESS_EVERY == 0:
            self.stream.write(
                f"kvchat: {self.path}: {progress.sessions:,} conversations,"
                f" {progress.messages:,} messages read\n"
            )
        self.stream.flush()

    def clear(self) -> None:
        """Take the bar off the terminal (the import's lines follow)."""
        if self.drawn:
            self.drawn = False
            self.stream.write("\r\x1b[K")
            self.stream.flush()


# Width of the import's progress bar; lines off a terminal come every so many conversations.
BAR_WIDTH = 30
PROGRESS_EVERY = 1000


@click.command(name="import")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--no-kv", is_flag=True, help="Take only the text of a bundle, not its KV.")
@model_options
@click.pass_context
def import_cmd(
    ctx: click.Context, files: tuple[Path, ...], as_json: bool, no_kv: bool, **flags: Any
) -> None:
    """Import conversations: kvchat JSON exports and bundles, OpenAI-style JSON, a ChatGPT
    conversations.json, an llm logs.db.

    A bundle's KV comes along when it was made with this model and settings. A file that
    can't be imported imports nothing and is reported on one line (exit status 2).
    """
    from kvchat.transfer import import_file
    from kvchat.transfer.bundle import NAME as BUNDLE

    sessions: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    with service(settings_from(ctx, **flags)) as chat:
        for path in files:
            progress = _ImportProgress(sys.stderr, path)
            try:
                try:
                    result = import_file(chat, path, kv=not no_kv, progress=progress)
                finally:
                    progress.clear()
            except KvchatError as exc:
                errors.append({"file": str(path), "error": str(exc)})
                if not as_json:
                    click.echo(f"kvchat: {exc}", err=True)
                continue
            for item in result.sessions:
                sessions.append({**item.to_json(), "file": str(path), "format": result.format})
            if as_json:
                continue
            if result.already:
                ids = ", ".join(item.session for item in result.sessions)
                click.echo(f"{path}: already imported (as {ids}); nothing imported again")
                continue
            for item in result.sessions:
                click.echo(_line(item, result.format == BUNDLE))
            if result.empty:
                click.echo(
                    f"{path}: {result.empty} conversation{'' if result.empty == 1 else 's'} "
                    "with no text (images, tool calls, empty messages) left out"
                )
    if as_json:
        document: dict[str, Any] = {"sessions": sessions}
        if errors:
            document["errors"] = errors
        click.echo(json.dumps(document, ensure_ascii=False))
    if errors:
        sys.exit(2)


def export_bundle(ctx: click.Context, session_ref: str, output: Path | None) -> None:
    """``kvchat export SESSION --format bundle -o FILE``: the text and the session's KV."""
    from kvchat.transfer import write_bundle

    if output is None or str(output) == "-":
        raise KvchatError("a bundle is a binary file: give it a name with -o FILE")
    with service(settings_from(ctx)) as chat:
        session = chat.sessions.resolve(session_ref)
        written = write_bundle(chat, session.id, output)
    if written.reason is None:
        kv = f"KV {written.kv_tokens:,} tokens, {human_bytes(written.kv_bytes)}"
    else:
        kv = f"text only: {written.reason}"
    click.echo(f"wrote {output} ({human_bytes(written.bytes)}; {kv})", err=True)
