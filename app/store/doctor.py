"""``kvchat doctor``: check the database, and salvage the text of a damaged one.

The damaged file is never written to or deleted: it is renamed aside (with its -wal and
-shm files) and read-only from there; a fresh database at the original path receives every
session and message that can still be read, row by row, so one broken page loses only the
rows on it. Snapshot rows are not salvaged (KV is a cache: the next turns rebuild it).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvchat.store.locks import file_lock
from kvchat.store.store import DamagedDatabase, Store

SIDE_FILES = ("-wal", "-shm")


@dataclass
class CheckReport:
    path: Path
    ok: bool
    detail: str
    sessions: int = 0
    messages: int = 0


@dataclass
class SalvageReport:
    path: Path
    moved_to: Path
    sessions: int = 0
    messages: int = 0
    lost: list[str] = field(default_factory=list)  # what could not be read, one line each


def check(path: Path) -> CheckReport:
    """Run SQLite's full integrity check without writing anything."""
    if not path.exists():
        return CheckReport(path, True, "no database yet")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            result = [r[0] for r in db.execute("PRAGMA integrity_check").fetchall()]
            if result != ["ok"]:
                return CheckReport(path, False, "; ".join(map(str, result[:5])))
            sessions = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
            messages = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return CheckReport(path, False, str(exc))
    return CheckReport(path, True, "ok", sessions, messages)


def _rows(db: sqlite3.Connection, table: str, lost: list[str]) -> Iterator[dict[str, Any]]:
    """Every readable row of ``table``: a whole scan, else rowid by rowid past broken pages."""
    try:
        cursor = db.execute(f"SELECT rowid AS _rowid, * FROM {table} ORDER BY rowid")
        names = [d[0] for d in cursor.description]
        yield from (dict(zip(names, r)) for r in cursor.fetchall())
        return
    except sqlite3.DatabaseError as exc:
        lost.append(f"{table}: a full scan failed ({exc}); reading row by row")
    try:
        high = db.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()[0] or 0
    except sqlite3.DatabaseError:
        high = 1_000_000
    misses = 0
    for rowid in range(1, high + 1):
        try:
            cursor = db.execute(f"SELECT rowid AS _rowid, * FROM {table} WHERE rowid=?", (rowid,))
            names = [d[0] for d in cursor.description]
            row = cursor.fetchone()
        except sqlite3.DatabaseError:
            lost.append(f"{table}: row {rowid} is unreadable")
            misses += 1
            if misses > 10_000:
                lost.append(f"{table}: gave up after 10,000 unreadable rows")
                return
            continue
        if row is not None:
            yield dict(zip(names, row))


def salvage(path: Path) -> SalvageReport:
    """Move the damaged database aside and copy its readable text into a fresh one."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    with file_lock(Store.lock_path(path)):
        path.rename(aside)
        for suffix in SIDE_FILES:
            side = path.with_name(path.name + suffix)
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
    report = SalvageReport(path, aside)
    fresh = Store(path)
    try:
        source = sqlite3.connect(f"file:{aside}?mode=ro", uri=True)
    except sqlite3.DatabaseError as exc:
        report.lost.append(f"the damaged file cannot be opened at all: {exc}")
        fresh.close()
        return report
    try:
        known: set[str] = set()
        for row in _rows(source, "sessions", report.lost):
            if fresh.restore_session(row):
                known.add(str(row["id"]))
                report.sessions += 1
        for row in _rows(source, "messages", report.lost):
            if str(row.get("session_id")) not in known:
                continue
            if fresh.restore_message(row):
                report.messages += 1
    except sqlite3.DatabaseError as exc:
        report.lost.append(f"reading stopped: {exc}")
    finally:
        source.close()
        fresh.close()
    return report


__all__ = ["CheckReport", "DamagedDatabase", "SalvageReport", "check", "salvage"]
