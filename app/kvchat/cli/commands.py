"""The ``kvchat`` command group and its session commands (cache and models in their modules)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvchat.cli.group import KvchatGroup, model_options, service, settings_from, shown, to_json
from kvchat.cli.progress import ProgressLine
from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.limits import RANGE_TEXT, sampling_problem
from kvchat.service.documents import DocumentShelf
from kvchat.service.exports import FORMATS
from kvchat.service.reasoning import NO_REASONING, ReasoningStream
from kvchat.system import current as current_system
from kvchat.text import check_text, fit_width, one_line
from kvchat.units import human_bytes

# Commands that run the model (None: the app): a native crash in them leaves a crash log.
MODEL_COMMANDS = (None, "ask", "bench", "import")


@click.group(cls=KvchatGroup, invoke_without_command=True)
@model_options
@click.version_option(package_name="kvchat")
@click.pass_context
def main(ctx: click.Context, **flags: Any) -> None:
    """kvchat: chat with local GGUF models; conversations resume without re-reading.

    Run `kvchat` with no command to open the terminal app; the commands below work
    from the shell and none of them opens the app.
    """
    ctx.obj = {k: v for k, v in flags.items() if v is not None}
    if ctx.invoked_subcommand in MODEL_COMMANDS:
        from kvchat.crashes import start_crash_log
        from kvchat.paths import data_dir

        start_crash_log(data_dir())
    if ctx.invoked_subcommand is None:
        settings = settings_from(ctx)
        try:
            from kvchat.tui.app import run_app
        except ImportError:
            raise KvchatError(
                "the terminal app is not available in this build; use `kvchat ask MESSAGE`"
            ) from None
        run_app(settings)


@main.command()
@click.argument("message", required=False)
@click.option("--session", "session_ref", help="Continue this session (id or unique title prefix).")
@click.option("--new", "new", is_flag=True, help="Start a new session.")
@click.option(
    "--continue",
    "continue_reply",
    is_flag=True,
    help="Go on with the session's last reply (one stopped at the token limit); needs --session.",
)
@click.option("--system", "system", help="System prompt (for a new session, or replacing it).")
@click.option("--max-tokens", type=int, help="Most tokens to generate (1 or more).")
@click.option(
    "--temperature", type=float, help=f"{RANGE_TEXT['temperature']}; 0 for greedy decoding."
)
@click.option("--top-p", "top_p", type=float, help=f"Nucleus sampling, {RANGE_TEXT['top_p']}.")
@click.option("--seed", type=int, help="Sampling seed (0 or more).")
@click.option("--no-restore", is_flag=True, help="Ignore saved KV: full prefill (the baseline).")
@click.option(
    "--think/--no-think",
    "think",
    default=None,
    help="Turn a thinking model's reasoning on or off for this session (where its template can).",
)
@click.option(
    "--attach",
    "-a",
    "attach",
    multiple=True,
    help="A file or folder for the model to read (repeatable): text, Markdown, code, CSV, "
    "HTML, PDF. With --new (or no --session) it is read once for every conversation "
    "started with the same documents; with --session it comes with this message.",
)
@click.option(
    "--glob",
    help="Which files of an attached folder, e.g. '*.py' or 'docs/**/*.md' "
    "(its .gitignore is respected).",
)
@click.option(
    "--doc",
    "library_docs",
    multiple=True,
    help="A document of the library (kvchat docs list), by name or id (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@model_options
@click.pass_context
def ask(
    ctx: click.Context,
    message: str | None,
    session_ref: str | None,
    new: bool,
    continue_reply: bool,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    no_restore: bool,
    think: bool | None,
    attach: tuple[str, ...],
    glob: str | None,
    library_docs: tuple[str, ...],
    as_json: bool,
    **flags: Any,
) -> None:
    """One turn: send MESSAGE (- reads it from stdin), stream the reply to stdout.

    Without --session or --new, a new session is started; a new session that gets no
    reply (an error, an interrupted turn) is not kept. Invalid settings or an empty
    message are refused before anything is stored.
    """
    if session_ref is not None and new:
        raise KvchatError("use either --session or --new, not both")
    if session_ref is not None and not session_ref.strip():
        raise KvchatError("--session needs a session id or title (see `kvchat list`)")
    # Bytes of the command line that are not UTF-8 arrive as lone surrogates: refused here,
    # before a session exists (paths elsewhere may hold such bytes; text may not).
    sampling = {
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
    }
    n_ctx = flags.get("n_ctx") or (ctx.obj or {}).get("n_ctx")
    for name, value in sampling.items():
        problem = None if value is None else sampling_problem(name, value, n_ctx)
        if problem:
            raise KvchatError(problem)
    if attach and library_docs:
        raise KvchatError("use either --attach or --doc (the library's documents), not both")
    if glob is not None and not attach:
        raise KvchatError("--glob picks files of an attached folder: give --attach FOLDER too")
    if continue_reply:
        if attach or library_docs:
            raise KvchatError("--continue goes on inside a reply: attach with a new message")
        if session_ref is None or message is not None or new:
            raise KvchatError("--continue goes on with a session's last reply: --session S alone")
    elif message is None:
        raise KvchatError("no message: give MESSAGE, or - to read it from stdin")
    if message == "-":
        # Bytes that are not UTF-8 become lone surrogates, refused by check_text below.
        message = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    if message is not None:
        check_text(message, "the message")
        if not message.strip():
            raise KvchatError("the message is empty")
    if system is not None:
        check_text(system, "the system prompt")
    settings = settings_from(ctx, **flags)
    if settings.engine != "openai":  # an OpenAI-compatible server has its own model
        from kvchat.planner.model_lookup import model_path

        model_path(settings)
    documents = DocumentShelf.read(attach, glob) if attach else None
    for note in documents.notes if documents else ():
        click.echo(f"kvchat: skipped {one_line(note)}", err=True)
    reading = _ReadingLine(sys.stderr)  # a long prompt says how far its read is
    printer = _ReplyPrinter()
    turn: dict[str, Any] = dict(
        on_token=None if as_json else reading.then(printer.feed),
        no_restore=no_restore,
        documents=documents,
        **sampling,
    )
    with service(settings) as chat:
        if settings.engine != "openai":  # a server's is opened by the turn: its refusal
            chat.load_engine()  # then leaves the message stored
        printer.style = chat.host.reasoning_style
        chat.turns.prefill_progress = reading
        if library_docs:
            turn["documents"] = documents = chat.library.documents_for(library_docs)
        for notice in chat.host.startup_notices():
            click.echo(f"kvchat: {one_line(notice)}", err=True)
        if think is not None and chat.host.thinking_switch.keyword is None:
            click.echo("kvchat: this model's chat template has no thinking switch", err=True)
        if session_ref is not None:
            session = chat.sessions.resolve(session_ref)
            if system is not None:
                chat.sessions.configure(session.id, system_prompt=system)
            if think is not None:
                _set_think(chat, session, think)
            if continue_reply:
                del turn["documents"]
                report = chat.continue_reply(session.id, **turn)
            else:
                assert message is not None
                report = chat.send(session.id, message, **turn)
        else:
            assert message is not None
            if documents is not None and not as_json:
                fit = chat.turns.check_documents(
                    documents, system, max_tokens or settings.max_tokens
                )
                if fit is not None:
                    click.echo(f"kvchat: documents: {fit.line()}", err=True)
            report = chat.start(message, system_prompt=system, think=think, **turn)
    reading.clear()
    if as_json:
        click.echo(to_json(report.to_json()))
    else:
        printer.end()
    if report.reply_error:
        # The reply is shown above; say once, and last, what of it the database holds.
        if report.stored_part is not None:
            raise KvchatError(report.reply_error)
        raise KvchatError(f"{report.reply_error} (the reply above is not stored)")
    if as_json:
        return
    if chat.host.plan_note:
        click.echo(f"plan: {chat.host.plan_note}", err=True)
    click.echo(f"[{report.session_id}] {shown(report.summary(), sys.stderr)}", err=True)
    warning = report.view.warning() if report.view is not None else None
    if warning is not None:  # the app's /compact is `kvchat compact SESSION` here
        warning = warning.replace("/compact", f"kvchat compact {report.session_id}")
        click.echo(f"kvchat: {warning}", err=True)
    if documents is not None:
        names = ", ".join(row.name for row in documents.rows)
        how = "read once for this conversation" if session_ref else _read_once(report)
        click.echo(f"kvchat: {shown(names, sys.stderr)}: {how}", err=True)
    if report.finish_reason == "length" and report.message_id is not None:
        click.echo(
            f"kvchat: to go on: kvchat ask --continue --session {report.session_id}", err=True
        )
    if report.message_id is None and continue_reply:
        click.echo("kvchat: the model added nothing to the reply", err=True)
    elif report.message_id is None:
        click.echo(
            f"kvchat: the model gave no reply; your message is saved in session "
            f"{report.session_id} without one",
            err=True,
        )
    if report.snapshot.error:
        click.echo(f"kvchat: {one_line(report.snapshot.error)}", err=True)


class _ReadingLine:
    """How far a long prompt's read is, on stderr (see :class:`ProgressLine`)."""

    def __init__(self, stream: Any) -> None:
        self.progress = ProgressLine(stream)

    def clear(self) -> None:
        """Take the redrawn line off the terminal (the reply follows)."""
        self.progress.clear()

    def then(self, write: Callable[[str], None]) -> Callable[[str], None]:
        """``write`` for the reply's pieces, clearing the line first."""

        def piece(text: str) -> None:
            self.clear()
            write(text)

        return piece

    def __call__(self, done: int, total: int, seconds: float) -> None:
        from kvchat.service.reports import reading_phrase

        self.progress.show(
            total, seconds, lambda: f"kvchat: {reading_phrase(done, total, seconds)}"
        )


def _set_think(chat: Any, session: Any, think: bool) -> None:
    """Keep ``--think``/``--no-think`` as the session's switch."""
    chat.sessions.configure(session.id, settings={**session.settings, "think": think})


class _ReplyPrinter:
    """A streaming reply: a thinking model's reasoning to stderr (dimmed on a terminal),
    the answer to stdout, so ``kvchat ask Q > answer.txt`` keeps the answer alone."""

    def __init__(self) -> None:
        self.style = NO_REASONING
        self._split: ReasoningStream | None = None
        self._thought = False

    def feed(self, piece: str) -> None:
        if self._split is None:
            self._split = ReasoningStream(self.style)
        reasoning, answer = self._split.feed(piece)
        if reasoning:
            tty = sys.stderr.isatty()
            sys.stderr.write(
                ("\x1b[2m" if tty else "") + shown(reasoning) + ("\x1b[0m" if tty else "")
            )
            sys.stderr.flush()
            self._thought = True
        if answer:
            if self._thought:
                sys.stderr.write("\n")
                self._thought = False
            _stream(answer)

    def end(self) -> None:
        if self._thought:
            sys.stderr.write("\n")
        sys.stdout.write("\n")
        sys.stdout.flush()


def _stream(piece: str) -> None:
    """Write a piece of the reply as it comes (on a terminal, never a control sequence).

    When the reader goes away (``kvchat ask … | head -1``) the turn still ends and its
    reply is stored: what is left goes to /dev/null.
    """
    try:
        sys.stdout.write(shown(piece))
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()


def _database_exists() -> bool:
    """Whether there is a database to read (a read-only command makes none)."""
    from kvchat.paths import data_dir

    return (data_dir() / "kvchat.db").exists()


def _drop_stdout() -> None:
    """The reader of stdout went away: what is left goes to /dev/null (no error at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _print(text: str) -> None:
    """Print ``text`` to stdout; a reader that stops early (``kvchat list | head -1``) ends
    the output quietly, not with an error."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()


# `kvchat list` reads this many sessions at a time (--all, or a pipe): memory stays flat.
LIST_PAGE = 500
_LIST_HEADER = f"{'ID':<9} {'TITLE':<32} {'MSGS':>5} {'TOKENS':>7} {'UPDATED':<17} {'SNAPSHOT':>10}"


def _list_line(s: Any) -> str:
    """One session's row; columns by display width (a wide CJK title takes two a character).
    A pinned session's title starts with ★; its tags follow the snapshot's size."""
    from kvchat.store.tags import tags_text

    title = fit_width(("★ " if s.session.pinned else "") + one_line(s.session.title), 32)
    snap = human_bytes(s.snapshot_bytes) if s.snapshot_bytes else "-"
    updated = s.session.updated[:16].replace("T", " ")
    line = f"{s.session.id:<9} {title} {s.messages:>5} {s.size:>7} {updated:<17} {snap:>10}"
    return f"{line}  {tags_text(s.session.tags)}" if s.session.tags else line


def _screen_rows() -> int:
    """Sessions that fit one screen under the header, leaving a line for the note after."""
    import shutil

    return max(5, shutil.get_terminal_size().lines - 3)


@main.command(name="list")
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list (every session, unless --limit)."
)
@click.option(
    "-n",
    "--limit",
    type=click.IntRange(min=1),
    help="Show the N most recently updated sessions (default: one screen on a terminal).",
)
@click.option("--all", "show_all", is_flag=True, help="Show every session.")
@click.option("--pinned", is_flag=True, help="Only the pinned sessions (★).")
@click.option("--tag", "tag_text", metavar="TAG", help="Only the sessions tagged TAG (#TAG too).")
@click.pass_context
def list_sessions(
    ctx: click.Context,
    as_json: bool,
    limit: int | None,
    show_all: bool,
    pinned: bool,
    tag_text: str | None,
) -> None:
    """Sessions, most recently updated first (reads only: no database is made).

    On a terminal one screen of them, and how many more there are; into a pipe, or with
    --all, every one (read a page at a time). TOKENS is what the app's list shows: the
    saved KV's tokens, else the messages' counts summed.
    """
    if show_all and limit is not None:
        raise KvchatError("use either --limit or --all, not both")
    tag = None
    if tag_text is not None:
        from kvchat.store.tags import parse_tags

        tags = parse_tags(tag_text)
        if len(tags) != 1:
            raise KvchatError("--tag takes one tag (a word of letters, digits, - or _)")
        tag = tags[0]
    if limit is None and not show_all and not as_json and sys.stdout.isatty():
        limit = _screen_rows()
    if not _database_exists():
        _print("[]" if as_json else 'No sessions yet. Start one with: kvchat ask --new "Hello"')
        return
    items: list[dict[str, Any]] = []  # --json: one list, printed at the end
    from kvchat.paths import data_dir
    from kvchat.service.session_index import SessionIndex

    settings_from(ctx)  # a broken configuration is said here as by every command
    with SessionIndex(data_dir() / "kvchat.db") as chat:
        shown_rows = 0
        after = None
        while limit is None or shown_rows < limit:
            size = LIST_PAGE if limit is None else min(LIST_PAGE, limit - shown_rows)
            page = chat.reader.list_sessions_page(size, after, pinned=pinned, tag=tag)
            if as_json:
                items.extend(s.to_json() for s in page.sessions)
            elif page.sessions:
                lines = [_list_line(s) for s in page.sessions]
                _print("\n".join([_LIST_HEADER, *lines] if shown_rows == 0 else lines))
            shown_rows += len(page.sessions)
            after = page.next
            if after is None:
                break
        more = (
            chat.reader.count_sessions(pinned=pinned, tag=tag) - shown_rows
            if after is not None
            else 0
        )
    if as_json:
        _print(to_json(items, indent=2))
    elif shown_rows == 0 and (pinned or tag):
        what = " and ".join(
            ([] if not pinned else ["pinned"]) + ([f"tagged #{tag}"] if tag else [])
        )
        _print(f"No sessions {what} (the app's Ctrl+G sets tags, Shift+F3 pins)")
    elif shown_rows == 0:
        _print('No sessions yet. Start one with: kvchat ask --new "Hello"')
    elif more > 0:
        plural = "s" if more != 1 else ""
        click.echo(f"… {more:,} more session{plural} (kvchat list --all, or --limit N)", err=True)


@main.command()
@click.argument("session_ref", required=False)
@click.option(
    "--format", "fmt", type=click.Choice([*FORMATS, "bundle"]), default="md", show_default=True
)
@click.option(
    "-o",
    "--output",
    type=click.Path(allow_dash=True, path_type=Path),
    help="Write to FILE (- for stdout, the default); with --all, into the folder DIR.",
)
@click.option(
    "--all",
    "export_all",
    is_flag=True,
    help="Every session, one file each (named by its id) in the folder given by -o DIR.",
)
@click.option(
    "--no-reasoning",
    "no_reasoning",
    is_flag=True,
    help="Leave thinking models' reasoning out (it is kept apart from the answers).",
)
@click.pass_context
def export(
    ctx: click.Context,
    session_ref: str | None,
    fmt: str,
    output: Path | None,
    export_all: bool,
    no_reasoning: bool,
) -> None:
    """Export a session as Markdown, JSON or HTML (to a terminal, without control sequences);
    or, with --all -o DIR, every session."""
    if export_all:
        return _export_all(ctx, session_ref, fmt, output, not no_reasoning)
    if session_ref is None:
        raise KvchatError("name the session to export (see `kvchat list`), or use --all -o DIR")
    if fmt == "bundle":
        from kvchat.cli.transfer_commands import export_bundle

        return export_bundle(ctx, session_ref, output)  # text + KV, see kvchat.transfer
    settings = settings_from(ctx)
    if not _database_exists():  # reads only: no database is made to say there is nothing
        raise KvchatError(f"no session matches {session_ref!r} (no sessions yet)")
    with service(settings) as chat:
        session = chat.sessions.resolve(session_ref)
        text = chat.sessions.export(session.id, fmt, not no_reasoning)  # type: ignore[arg-type]
    if output is None or str(output) == "-":
        try:
            sys.stdout.write(shown(text))
            sys.stdout.flush()
        except BrokenPipeError:  # `kvchat export S | head`: the reader has what it wanted
            _drop_stdout()
        return
    _write_private(output, text)  # 0600, as the app's exports and --all's
    click.echo(f"wrote {output}", err=True)


# `kvchat export --all` reads this many sessions at a time.
EXPORT_PAGE = 200
_EXTENSIONS = {"md": "md", "json": "json", "html": "html"}


def _export_all(
    ctx: click.Context,
    session_ref: str | None,
    fmt: str,
    output: Path | None,
    reasoning: bool = True,
) -> None:
    """``kvchat export --all -o DIR``: every session as DIR/<id>.<format>, a page of the
    list at a time. Files are named by session id, never by title; made 0600, replacing a
    file of that name but never following a link."""
    if session_ref is not None:
        raise KvchatError("--all exports every session: name none")
    if fmt == "bundle":
        raise KvchatError(
            "bundles are exported one session at a time (kvchat export S --format bundle -o FILE)"
        )
    if output is None or str(output) == "-":
        raise KvchatError("--all writes one file per session: give the folder with -o DIR")
    try:
        output.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise KvchatError(f"cannot make the folder {output}: {exc.strerror or exc}") from None
    written = 0
    if _database_exists():
        with service(settings_from(ctx)) as chat:
            after = None
            while True:
                page = chat.reader.list_sessions_page(EXPORT_PAGE, after)
                for summary in page.sessions:
                    session_id = summary.session.id
                    text = chat.sessions.export(session_id, fmt, reasoning)  # type: ignore[arg-type]
                    _write_private(output / f"{session_id}.{_EXTENSIONS[fmt]}", text)
                    written += 1
                after = page.next
                if after is None:
                    break
    plural = "" if written == 1 else "s"
    click.echo(f"wrote {written:,} session{plural} to {output}", err=True)


def _read_once(report: Any) -> str:
    """What a new conversation's turn did with its documents."""
    if report.remote is not None:  # an OpenAI-compatible server: its own cache decides
        reused = report.tokens.shown("reused")
        return f"sent as text; the server's cache reused {reused} prompt tokens (its figure)"
    if report.restore.donor is not None and report.restore.tokens:
        return f"restored ({report.restore.tokens:,} tokens read by an earlier conversation)"
    return "read once for all conversations started with them"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (0600; an existing file replaced, a link refused)."""
    try:
        fd = current_system().open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise KvchatError(f"cannot write {path}: {exc.strerror or exc}") from None


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@click.option("--cold", is_flag=True, help="Evict snapshot files from the page cache first.")
@click.option(
    "--full",
    is_flag=True,
    help="The whole matrix (512 to 4,096 tokens, medians of 5, 12 turns of writes, both V "
    "layouts): many minutes. Without it: 1,024 and 4,096 tokens, medians of 3, 8 turns, "
    "one layout: under 2 minutes on 2 idle cores (it says how long up front).",
)
@click.option(
    "--sizes",
    default=None,
    help="History lengths in tokens, comma-separated [default: 1024,4096; 512,1024,2048,4096 "
    "with --full or --ui].",
)
@click.option(
    "--repeat",
    default=None,
    type=click.IntRange(min=1),
    help="Restore timings: median of N [default: 3; 5 with --full].",
)
@click.option("--no-tiers", is_flag=True, help="Skip the write-per-turn and fork measurements.")
@click.option(
    "--no-threads",
    is_flag=True,
    help="Skip timing the thread count in use against the physical cores (~10 s).",
)
@click.option(
    "--one-layout",
    is_flag=True,
    help="With --full: skip restores in the other V layout (flash attention the other way).",
)
@click.option(
    "--peers",
    is_flag=True,
    help="kvchat against re-reading, llama-cpp-python's LlamaDiskCache and llama-server's "
    "slot files, on the same conversations [sizes: 1024,4096; with --full also 16384 and "
    "the largest that fits].",
)
@click.option(
    "--docs",
    is_flag=True,
    help="Read once, ask forever: a document's first read against a later conversation's "
    "first word [sizes: 2048,8192 and the largest that fits].",
)
@click.option(
    "--turns",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --peers: turns of the conversation whose writes are measured.",
)
@click.option(
    "--conversations",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --peers: conversations sharing one prefix, for the disk they use.",
)
@click.option(
    "--prefix",
    "prefix_tokens",
    default=2000,
    show_default=True,
    type=click.IntRange(min=64),
    help="With --peers: the shared prefix's tokens.",
)
@click.option(
    "--ui", is_flag=True, help="The app's latencies instead: first paint, switch, jump, typing."
)
@click.option(
    "--sessions",
    help="With --ui: homes of N sessions (comma-separated) imported and measured against an "
    "empty one: first paint, idle CPU, RSS, echo, search, kvchat list, import rate; the "
    "largest also gets a 5,000-message session: switches, a search jump and echo while a "
    "reply streams into it.",
)
@click.option(
    "--messages", default=50, show_default=True, type=click.IntRange(min=1), help="Per session."
)
@click.option(
    "--idle", "idle_s", default=10.0, show_default=True, help="Seconds of idle CPU measured."
)
@model_options
@click.pass_context
def bench(
    ctx: click.Context,
    as_json: bool,
    cold: bool,
    full: bool,
    sizes: str | None,
    repeat: int | None,
    no_tiers: bool,
    no_threads: bool,
    one_layout: bool,
    peers: bool,
    docs: bool,
    turns: int,
    conversations: int,
    prefix_tokens: int,
    ui: bool,
    sessions: str | None,
    messages: int,
    idle_s: float,
    **flags: Any,
) -> None:
    """Resume vs full prefill, restore vs llama.cpp's loader, chunk writes and fork storage;
    --peers: against LlamaDiskCache and llama-server; --docs: a document read once."""
    from kvchat.bench.progress import TerminalReporter
    from kvchat.bench.runs import format_report, run_bench

    if docs:
        _bench_docs(ctx, as_json, sizes, flags)
        return
    if peers:
        _bench_peers(ctx, as_json, full, sizes, repeat, turns, conversations, prefix_tokens, flags)
        return
    if sizes is None:
        sizes = "512,1024,2048,4096" if full or ui else "1024,4096"
    if repeat is None:
        repeat = 5 if full or ui else 3
    try:
        targets = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"--sizes must be comma-separated integers, not {sizes!r}") from None
    settings = settings_from(ctx, **flags)
    progress = None if as_json else (lambda line: click.echo(line, err=True))
    if sessions is not None:
        if not ui:
            raise KvchatError("--sessions measures the app: use it with --ui")
        from kvchat.bench.scale import format_scale_report, run_scale_bench

        try:
            counts = [int(x) for x in sessions.split(",") if x.strip()]
        except ValueError:
            raise KvchatError(
                f"--sessions takes comma-separated counts, not {sessions!r}"
            ) from None
        if not counts or min(counts) < 1:
            raise KvchatError("--sessions takes counts of 1 or more")
        say = lambda line: click.echo(line, err=True)  # noqa: E731  (stderr: JSON stays clean)
        scale = run_scale_bench(
            settings, counts, messages, idle_s=idle_s, runs=max(1, repeat), progress=say
        )
        click.echo(json.dumps(scale.to_json(), indent=2) if as_json else format_scale_report(scale))
        return
    if ui:
        from kvchat.bench.ui import format_ui_report, run_ui_bench

        ui_report = run_ui_bench(settings, targets, repeat=repeat, progress=progress)
        shown = (
            json.dumps(ui_report.to_json(), indent=2) if as_json else format_ui_report(ui_report)
        )
        click.echo(shown)
        return
    report = run_bench(
        settings,
        targets,
        cold=cold,
        repeat=repeat,
        tiers=not no_tiers,
        layouts=full and not one_layout,
        threads=not no_threads,
        write_turns=12 if full else 8,
        reporter=None if as_json else TerminalReporter(),
    )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(format_report(report))


def _bench_docs(
    ctx: click.Context, as_json: bool, sizes: str | None, flags: dict[str, Any]
) -> None:
    """``kvchat bench --docs``: a document's first read against later conversations."""
    from kvchat.bench.docs import format_docs, run_docs
    from kvchat.bench.progress import TerminalReporter

    try:
        targets = [int(x) for x in (sizes or "2048,8192").split(",") if x.strip()]
    except ValueError:
        raise KvchatError(f"--sizes must be comma-separated integers, not {sizes!r}") from None
    settings = settings_from(ctx, **flags)
    report = run_docs(settings, targets, reporter=None if as_json else TerminalReporter())
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else format_docs(report))


def _bench_peers(
    ctx: click.Context,
    as_json: bool,
    full: bool,
    sizes: str | None,
    repeat: int | None,
    turns: int,
    conversations: int,
    prefix_tokens: int,
    flags: dict[str, Any],
) -> None:
    """``kvchat bench --peers``: every row on the same conversations, in one run."""
    from kvchat.bench.peers import format_peers, run_peers
    from kvchat.bench.progress import TerminalReporter

    settings = settings_from(ctx, **flags)
    if sizes is None:
        targets = [1024, 4096]
        if full:
            largest = settings.n_ctx - 300
            targets += [t for t in (16384, largest) if t <= largest and t not in targets]
    else:
        try:
            targets = [int(x) for x in sizes.split(",") if x.strip()]
        except ValueError:
            raise KvchatError(f"--sizes must be comma-separated integers, not {sizes!r}") from None
    report = run_peers(
        settings,
        sorted(set(targets)),
        repeat=repeat or 3,
        turns=turns,
        conversations=conversations,
        prefix=prefix_tokens,
        reporter=None if as_json else TerminalReporter(),
    )
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else format_peers(report))


@main.command(name="config")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@model_options
@click.pass_context
def config_cmd(ctx: click.Context, as_json: bool, **flags: Any) -> None:
    """The effective settings and where each came from (flag, env, config file, plan, default)."""
    from kvchat.engine.probe import probe_words
    from kvchat.paths import config_file
    from kvchat.planner.defaults import plan_defaults
    from kvchat.planner.model_lookup import model_path

    settings = settings_from(ctx, **flags)
    path = model_path(settings)
    plan = plan_defaults(settings, path)
    effective = plan.apply(settings)
    sources = settings.sources()
    sources.update(plan.sources)
    rows = {
        name: {"value": getattr(effective, name), "source": sources[name]}
        for name in type(settings).model_fields
    }
    probe = _probe_rows(effective, path, rows)
    for secret in ("server_api_key", "openai_api_key"):
        if rows[secret]["value"]:
            rows[secret]["value"] = "(set)"  # a secret is never printed
    rows["mcp"]["value"] = effective.mcp.summary()  # names only: env and headers hold secrets
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model_path": str(path),
                    "config_file": str(config_file()),
                    "settings": rows,
                    "plan": plan.to_json(),
                    "probe": probe.to_json() | {"words": probe_words(probe)} if probe else None,
                },
                indent=2,
            )
        )
        return
    click.echo(f"model file: {path}")
    click.echo(f"config file: {config_file()}" + ("" if config_file().is_file() else " (absent)"))
    click.echo(f"plan: {plan.note}")
    if probe is not None:
        click.echo(f"engine probe: {probe_words(probe)}")
        threads = probe.threads_line()
        if threads:
            click.echo(f"  {threads}")
    width = max(len(name) for name in rows)
    for name, row in rows.items():
        value = "-" if row["value"] is None else row["value"]
        click.echo(f"  {name:<{width}}  {one_line(str(value)):<24} {row['source']}")


@main.command()
@click.argument("session_ref")
@click.option(
    "--at",
    "at_number",
    type=int,
    help="Keep messages #1 to #N (#N as the app shows it, not an id; default: all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the new session as one JSON object.")
@click.pass_context
def fork(ctx: click.Context, session_ref: str, at_number: int | None, as_json: bool) -> None:
    """Branch a session; the shared history's KV is reused, not copied.

    --at N keeps the first N messages: N is the message's number in the session (#N in the
    app), not a database id. Forks are titled "Fork at #N: TITLE" ("Fork at #N (2): TITLE"…)
    """
    with service(settings_from(ctx)) as chat:
        parent = chat.sessions.resolve(session_ref)
        at_message = (
            None if at_number is None else chat.sessions.message_at(parent.id, at_number).id
        )
        child = chat.sessions.fork(parent.id, at_message)
        messages = len(chat.sessions.messages(child.id))
    if as_json:
        click.echo(
            to_json(
                {
                    "session": child.id,
                    "parent": parent.id,
                    "title": child.title,
                    "messages": messages,
                }
            )
        )
    else:
        click.echo(f"{child.id}  {one_line(child.title)}  ({messages} messages)")


main.add_lazy("cache", "kvchat.cli.cache:cache")
main.add_lazy("compact", "kvchat.cli.compact_command:compact")
main.add_lazy("docs", "kvchat.cli.docs_commands:docs_group")
main.add_lazy("doctor", "kvchat.cli.doctor:doctor")
main.add_lazy("models", "kvchat.cli.model_commands:models_group")
main.add_lazy("import", "kvchat.cli.transfer_commands:import_cmd")
main.add_lazy("server", "kvchat.cli.server_commands:server")
main.add_lazy("tools", "kvchat.cli.tools_commands:tools_group")


def _probe_rows(settings: Settings, path: Path, rows: dict[str, dict[str, Any]]) -> Any:
    """What the engine probe chose for these settings (probing now if this machine was not
    probed yet), written into ``rows``; None for a llama-server engine."""
    from kvchat.engine import engine_config
    from kvchat.engine.probe import probed_config

    if settings.engine != "llama.cpp":
        return None
    config, probe = probed_config(
        engine_config(settings, path), repack=settings.repack, threads=settings.n_threads is None
    )
    if probe is None:
        return None
    rows["repack"]["value"] = "on" if config.repack else "off"
    if settings.repack == "auto":
        rows["repack"]["source"] = "probe"
    if settings.n_threads is None:
        rows["n_threads"] = {"value": config.n_threads, "source": "probe"}
        rows["n_threads_batch"] = {"value": config.n_threads_batch, "source": "probe"}
    for name in ("flash_attn", "n_gpu_layers"):
        if getattr(config, name) != rows[name]["value"]:
            rows[name] = {"value": getattr(config, name), "source": "probe"}
    return probe
