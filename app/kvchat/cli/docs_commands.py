"""``kvchat docs ...``: the document library (see :mod:`kvchat.service.library`).

- ``kvchat docs add PATH... [--glob G]``: keep the documents and read each one now, for the
  current model and KV type, so a conversation about it (``kvchat ask --new --doc NAME``)
  starts with no prefill; a progress line says tokens read and time left; Ctrl+C cancels
  cleanly (the document being read, and those after it, are not stored);
- ``kvchat docs list [--json]``: per document its kind, tokens, KV bytes on disk, the
  conversations using it, the model and KV type it was read with, and whether the file
  changed on disk since;
- ``kvchat docs rm NAME|ID``: take it out of the library; its KV is no longer kept from the
  disk budget's eviction (conversations that used it keep its text).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from kvchat.cli.group import KvchatGroup, model_options, service, settings_from, shown, to_json
from kvchat.cli.progress import ProgressLine
from kvchat.errors import KvchatError
from kvchat.text import check_text, one_line
from kvchat.units import human_bytes


@click.group(name="docs", cls=KvchatGroup)
def docs_group() -> None:
    """The document library: documents read once, ahead of time, for every conversation."""


class _Progress:
    """One line on stderr while a document is read (see :class:`ProgressLine`)."""

    def __init__(self) -> None:
        self.progress = ProgressLine(sys.stderr)

    def __call__(self, name: str, done: int, total: int, seconds: float) -> None:
        from kvchat.service.library import reading_progress_line

        def line() -> str:
            said = shown(name, self.progress.stream)
            return f"kvchat: {reading_progress_line(said, done, total, seconds)}"

        self.progress.show(total, seconds, line)

    def clear(self) -> None:
        """Take the line off the terminal; the next document's read starts its own."""
        self.progress.clear()
        self.progress.last = -1.0


@contextmanager
def _ctrl_c_cancels() -> Iterator[list[bool]]:
    """Ctrl+C sets a flag the read checks between batches, instead of raising wherever the
    interpreter happens to be (a half-written snapshot is then impossible)."""
    flag = [False]

    def handler(_signum: int, _frame: Any) -> None:
        flag[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: Ctrl+C stays as it is
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@docs_group.command("add")
@click.argument("paths", nargs=-1, required=True)
@click.option("--glob", help="Which files of a folder, e.g. '*.md' or 'docs/**/*.md'.")
@click.option("--system", "system", help="The system prompt conversations will start with.")
@model_options
@click.pass_context
def add(
    ctx: click.Context,
    /,
    paths: tuple[str, ...],
    glob: str | None,
    system: str | None,
    **flags: Any,
) -> None:
    """Keep PATHs' documents in the library and read each one now (its KV kept on disk)."""
    from kvchat.service.documents import DocumentShelf

    if system is not None:
        check_text(system, "the system prompt")
    settings = settings_from(ctx, **flags)
    read = DocumentShelf.read(paths, glob, library=True)
    for note in read.notes:
        click.echo(f"kvchat: skipped {one_line(note)}", err=True)
    progress = _Progress()
    with service(settings) as chat, _ctrl_c_cancels() as interrupted:
        for line in chat.library.plan(read.rows):
            click.echo(f"kvchat: {shown(line, sys.stderr)}", err=True)
        results = chat.library.add(read, system, progress=progress, cancel=lambda: interrupted[0])
        progress.clear()
    for result in results:
        click.echo(shown(result.line()))
    if any(not r.added for r in results):
        raise KvchatError("cancelled: the documents not read are not in the library")


@docs_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def list_docs(ctx: click.Context, as_json: bool) -> None:
    """The library's documents with their readings and the conversations using them."""
    settings = settings_from(ctx)
    with service(settings) as chat:
        entries = chat.library.entries()
    if as_json:
        click.echo(to_json({"documents": [e.to_json() for e in entries]}))
        return
    if not entries:
        click.echo("no documents in the library (kvchat docs add PATH)")
        return
    for entry in entries:
        doc = entry.document
        uses = f"{entry.conversations} conversation{'' if entry.conversations == 1 else 's'}"
        line = (
            f"{doc.name}  {doc.kind}  {entry.tokens:,} tokens  "
            f"{human_bytes(entry.disk_bytes)} KV on disk  {uses}  [{doc.id[:8]}]"
        )
        click.echo(shown(line))
        for reading in entry.readings:
            where = "" if reading.disk_bytes else "  (its KV is not on disk: read again)"
            click.echo(shown(f"    read with {reading.model}, {reading.kv_type} KV{where}"))
        if not entry.readings:
            click.echo("    not read yet")
        if entry.file_note is not None:
            note = (
                f"    {entry.file_note}: conversations keep the text it was read with; "
                f"kvchat docs add {doc.source or doc.name} reads the new version"
            )
            click.echo(shown(note))


@docs_group.command("rm")
@click.argument("ref", metavar="NAME|ID")
@click.pass_context
def remove(ctx: click.Context, ref: str) -> None:
    """Take a document out of the library; its KV may then be evicted like any other."""
    check_text(ref, "the document's name")
    settings = settings_from(ctx)
    with service(settings) as chat:
        document, readings = chat.library.remove(ref)
    kept = "" if not readings else "; its KV stays on disk until the disk budget needs the room"
    click.echo(shown(f"removed {document.name} from the library{kept}"))
