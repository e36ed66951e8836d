"""``kvchat doctor``: check the database; ``--salvage`` rescues the text of a damaged one.

Exit status: 0 when the database is sound (or was salvaged), 2 when it is damaged and
``--salvage`` was not given, so a script can tell the two apart. It never opens the
database for writing: the check is SQLite's ``integrity_check`` on a read-only
connection, and salvaging renames the damaged file aside (never deletes or changes it)
before copying what can be read into a fresh database.
"""

from __future__ import annotations

import click

from kvchat.engine.probe import probe_words
from kvchat.errors import KvchatError
from kvchat.paths import data_dir
from kvchat.text import one_line

# Lines of what could not be read shown after a salvage (the count is always shown).
SHOW_LOST = 10
# SQLite's words for a file it could not read at all (permissions, I/O), which is no damage.
UNREADABLE = ("disk I/O error", "unable to open database file", "readonly", "locked")


@click.command(name="doctor")
@click.option(
    "--salvage",
    "do_salvage",
    is_flag=True,
    help="Move a damaged database aside and salvage its text into a fresh one.",
)
def doctor(do_salvage: bool) -> None:
    """Check the database; with --salvage, rescue the conversations of a damaged one.

    Exit status 0: the database is sound (or was salvaged); 2: it is damaged.
    """
    # Imported here: `kvchat --version` loads no store.
    from kvchat.service.checks import disk_full
    from kvchat.store.integrity import check, salvage

    path = data_dir() / "kvchat.db"
    _engine_report()
    if path.exists() and disk_full(path.parent):
        # SQLite cannot even read a WAL database without room for its shared-memory file:
        # that is no damage, and salvaging now would make things worse.
        raise KvchatError(
            f"the disk holding {path} is full: free some space, then run `kvchat doctor` again"
        )
    report = check(path)
    if report.ok:
        if not path.exists():
            click.echo(f"ok (no database yet at {path})")
        else:
            click.echo(f"ok ({report.sessions} sessions, {report.messages} messages) {path}")
        if do_salvage:
            click.echo("nothing to salvage: the database is sound")
        return
    if any(sign in report.detail for sign in UNREADABLE):
        raise KvchatError(
            f"cannot read the database {path} ({one_line(report.detail)}); it is not known "
            "to be damaged, so nothing was moved or salvaged"
        )
    click.echo(f"damaged: {one_line(report.detail)}")
    if not do_salvage:
        raise KvchatError(
            f"the database {path} is damaged: run `kvchat doctor --salvage` to move it "
            "aside (kept as it is) and salvage its conversations into a fresh database"
        )
    done = salvage(path)
    click.echo(
        f"salvaged {done.sessions} sessions, {done.messages} messages into a fresh database; "
        f"the damaged file is kept at {done.moved_to}"
    )
    for table, counts in done.tables.items():  # what SQLite read, what came from pages
        click.echo(counts.line(table))
    for line in done.lost[:SHOW_LOST]:
        click.echo(f"  {one_line(line)}")
    if len(done.lost) > SHOW_LOST:
        click.echo(f"  … and {len(done.lost) - SHOW_LOST} more")
    click.echo("KV snapshots are not salvaged: the next turn of each session re-reads it once")


def _engine_report() -> None:
    """What the engine probe chose on this machine, and the recent crashes (read only: the
    probe itself is not run here)."""
    from kvchat.crashes import recent_crashes
    from kvchat.engine.probe import known_outcomes, probe_file

    click.echo(
        f"engine probe file: {probe_file(data_dir())} (what the probe found safe and fast "
        "here; delete it to probe again)"
    )
    for outcome in known_outcomes(data_dir())[:3]:
        click.echo(
            f"engine probe ({outcome.when}, {outcome.probe_ms:.0f} ms): {probe_words(outcome)}"
        )
        threads = outcome.threads_line()
        if threads:
            click.echo(f"  {threads}")
    crashes = recent_crashes(data_dir())
    if not crashes:
        click.echo("crashes: none recorded; unclean ends: none recorded")
    for report in crashes[:SHOW_LOST]:
        if report.killed:
            click.echo(
                f"unclean end: the run started {report.when_text} (pid {report.pid}) did not "
                "exit cleanly (killed, or the machine stopped); a reply it was writing shows "
                f"as “cut off: kvchat ended”; marker: {report.path}"
            )
            continue
        where = "in the model engine (llama.cpp)" if report.in_engine else "in kvchat"
        click.echo(
            f"crash {report.when_text} {where}: {one_line(report.first_line)}; log: {report.path}"
        )
