"""``kvchat doctor``: check the database, and salvage the text of a damaged one.

The damaged file is never written to or deleted: it is renamed aside (with its -wal and
-shm files) and read-only from there; a fresh database at the original path receives every
session and message that can still be read: first what SQLite reads (a whole scan, else
row by row), then what is left on the file's pages where SQLite cannot reach it (a file
cut short, a damaged header or interior page: :mod:`kvchat.store.page_scan`, the approach
of ``sqlite3 .recover``), so one broken page loses only the rows on it. The report says,
per table, what came from where. Snapshot rows are not salvaged (KV is a cache: the next
turns rebuild it).
"""

from __future__ import annotations

import re
import sqlite3
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvchat.store import page_scan
from kvchat.store.connection import check_connection, read_only_uri
from kvchat.store.locks import file_lock
from kvchat.store.store import DamagedDatabase, Store

SIDE_FILES = ("-wal", "-shm")
# What reading a damaged file can raise: SQLite's errors, and its message about the damage
# when that quotes bytes that are not UTF-8 (Python cannot even decode the error).
READ_ERRORS = (sqlite3.DatabaseError, UnicodeDecodeError)


@dataclass
class CheckReport:
    path: Path
    ok: bool
    detail: str
    sessions: int = 0
    messages: int = 0


@dataclass
class TableSalvage:
    """What one table gave: rows SQLite read, rows recovered from its pages."""

    read: int = 0
    recovered: int = 0
    lost: int = 0  # rows SQLite could not read and no page held
    # Rows may be lost beyond ``lost`` that nothing counts (messages of a session whose row,
    # which counts them, is gone too).
    more_lost_uncounted: bool = False

    def line(self, table: str) -> str:
        uncounted = (
            ", and an unknown number more (the rows that counted them are gone)"
            if self.more_lost_uncounted
            else ""
        )
        return (
            f"{table}: {self.read} read by SQLite, {self.recovered} recovered from its "
            f"pages, {self.lost} unreadable rows lost{uncounted}"
        )


@dataclass
class SalvageReport:
    path: Path
    moved_to: Path
    sessions: int = 0
    messages: int = 0
    lost: list[str] = field(default_factory=list)  # what could not be read, one line each
    tables: dict[str, TableSalvage] = field(default_factory=dict)


def check(path: Path) -> CheckReport:
    """Run SQLite's full integrity check without writing anything."""
    if not path.exists():
        return CheckReport(path, True, "no database yet")
    try:
        db = check_connection(path)
        try:
            result = [r[0] for r in db.execute("PRAGMA integrity_check").fetchall()]
            if result != ["ok"]:
                return CheckReport(path, False, "; ".join(map(str, result[:5])))
            sessions = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
            messages = db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        finally:
            db.close()
    except READ_ERRORS as exc:
        return CheckReport(path, False, str(exc))
    return CheckReport(path, True, "ok", sessions, messages)


def _rows(
    db: sqlite3.Connection, table: str, lost: list[str], unreadable: set[int]
) -> Iterator[dict[str, Any]]:
    """Every row of ``table`` SQLite reads: a whole scan, else rowid by rowid past broken
    pages (the rowids it cannot read go to ``unreadable``: the page scan may hold them)."""
    try:
        cursor = db.execute(f"SELECT rowid AS _rowid, * FROM {table} ORDER BY rowid")
        names = [d[0] for d in cursor.description]
        yield from (dict(zip(names, r)) for r in cursor.fetchall())
        return
    except READ_ERRORS as exc:
        lost.append(f"{table}: SQLite's full scan failed ({exc}); reading row by row")
    try:
        high = db.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()[0] or 0
    except READ_ERRORS:
        high = 0  # not even the table's last row: the page scan reads what is left
    misses = 0
    for rowid in range(1, high + 1):
        try:
            cursor = db.execute(f"SELECT rowid AS _rowid, * FROM {table} WHERE rowid=?", (rowid,))
            names = [d[0] for d in cursor.description]
            row = cursor.fetchone()
        except READ_ERRORS:
            unreadable.add(rowid)
            misses += 1
            if misses > 10_000:
                lost.append(f"{table}: SQLite gave up after 10,000 unreadable rows")
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
    sessions = report.tables.setdefault("sessions", TableSalvage())
    messages = report.tables.setdefault("messages", TableSalvage())
    fresh = Store(path)
    try:
        unreadable: dict[str, set[int]] = {"sessions": set(), "messages": set()}
        read_sessions, read_messages = _read_with_sqlite(aside, report.lost, unreadable)
        sessions.read, messages.read = len(read_sessions), len(read_messages)
        found_sessions, found_messages = _read_pages(fresh, aside, report.lost)
        for session_id, row in found_sessions.items():
            if session_id not in read_sessions:
                read_sessions[session_id] = row
                sessions.recovered += 1
        for message_id, row in found_messages.items():
            if message_id not in read_messages:
                read_messages[message_id] = row
                messages.recovered += 1
        messages.lost = max(
            len(unreadable["messages"] - set(read_messages)),
            _missing_by_counts(read_sessions, read_messages),
        )
        sessions.lost = max(0, len(unreadable["sessions"]) - sessions.recovered)
        orphans = {str(m.get("session_id")) for m in read_messages.values()} - set(read_sessions)
        messages.more_lost_uncounted = bool(orphans)
        for session_id in sorted(orphans):
            if _SESSION_ID.fullmatch(session_id):  # its messages survived, its row did not
                read_sessions[session_id] = {"id": session_id, "title": f"Recovered {session_id}"}
                report.lost.append(f"session {session_id}: its row is lost; titled 'Recovered'")
        for row in read_sessions.values():
            if fresh.restore_session(row):
                report.sessions += 1
        known = set(read_sessions)
        for message_id in sorted(read_messages):
            row = read_messages[message_id]
            if str(row.get("session_id")) in known and fresh.restore_message(row):
                report.messages += 1
    finally:
        fresh.close()
    return report


def _missing_by_counts(
    sessions: dict[str, dict[str, Any]], messages: dict[int, dict[str, Any]]
) -> int:
    """Messages the sessions' own rows count but no page held (a file cut short loses its
    last pages: SQLite cannot even say how many rows were on them)."""
    found: dict[str, int] = {}
    for row in messages.values():
        found[str(row.get("session_id"))] = found.get(str(row.get("session_id")), 0) + 1
    missing = 0
    for session_id, row in sessions.items():
        recorded = row.get("n_messages")
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            missing += max(0, recorded - found.get(session_id, 0))
    return missing


_SESSION_ID = re.compile(r"[0-9a-f]{8,64}")
_ROLES = ("user", "assistant", "system")


def _read_with_sqlite(
    aside: Path, lost: list[str], unreadable: dict[str, set[int]]
) -> tuple[dict[str, dict[str, Any]], dict[int, dict[str, Any]]]:
    """What SQLite itself reads of sessions and messages (by id)."""
    sessions: dict[str, dict[str, Any]] = {}
    messages: dict[int, dict[str, Any]] = {}
    try:
        source = sqlite3.connect(read_only_uri(aside), uri=True)
    except READ_ERRORS as exc:
        lost.append(f"SQLite cannot open the damaged file at all: {exc}")
        return sessions, messages
    try:
        for row in _rows(source, "sessions", lost, unreadable["sessions"]):
            if isinstance(row.get("id"), str):
                sessions[row["id"]] = row
        for row in _rows(source, "messages", lost, unreadable["messages"]):
            if isinstance(row.get("id"), int):
                messages[row["id"]] = row
    except READ_ERRORS as exc:
        lost.append(f"SQLite stopped reading: {exc}")
    finally:
        source.close()
    return sessions, messages


def _read_pages(
    fresh: Store, aside: Path, lost: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Sessions and messages found on the damaged file's pages, told apart by their shape
    (the columns of kvchat's own tables); a row's copy on a live page beats one on a free
    page (an older version of it)."""
    wal = aside.with_name(aside.name + "-wal")
    try:
        scanned = page_scan.scan(aside, wal if wal.exists() else None)
    except (OSError, ValueError, IndexError, struct.error) as exc:
        lost.append(f"the file's pages cannot be read: {exc}")
        return {}, {}
    lost.extend(scanned.notes)
    if scanned.bad_cells:
        lost.append(f"{scanned.bad_cells} rows on damaged pages could not be decoded")
    session_columns = [r["name"] for r in fresh._rows("PRAGMA table_info(sessions)")]
    message_columns = [r["name"] for r in fresh._rows("PRAGMA table_info(messages)")]
    sessions: dict[str, tuple[bool, dict[str, Any]]] = {}
    messages: dict[int, tuple[bool, dict[str, Any]]] = {}
    for record in scanned.records:
        values = record.values
        if _is_message(values, len(message_columns)):
            row = dict(zip(message_columns, values))
            row["id"] = record.rowid
            held = messages.get(record.rowid)
            if held is None or (held[0] and not record.free):
                messages[record.rowid] = (record.free, row)
        elif _is_session(values, len(session_columns)):
            row = dict(zip(session_columns, values))
            held_session = sessions.get(row["id"])
            if held_session is None or (held_session[0] and not record.free):
                sessions[row["id"]] = (record.free, row)
    return (
        {key: row for key, (_, row) in sessions.items()},
        {key: row for key, (_, row) in messages.items()},
    )


def _is_message(values: list[Any], width: int) -> bool:
    """A messages row: (NULL id, session id, role, content, created, ...)."""
    return (
        7 <= len(values) <= width
        and values[0] is None
        and isinstance(values[1], str)
        and _SESSION_ID.fullmatch(values[1]) is not None
        and values[2] in _ROLES
        and isinstance(values[3], str)
        and isinstance(values[4], str)
    )


def _is_session(values: list[Any], width: int) -> bool:
    """A sessions row: (id, title, system prompt, settings JSON, created, updated, ...)."""
    return (
        6 <= len(values) <= width
        and isinstance(values[0], str)
        and _SESSION_ID.fullmatch(values[0]) is not None
        and isinstance(values[1], str)
        and (values[2] is None or isinstance(values[2], str))
        and isinstance(values[3], str)
        and values[3].startswith("{")
        and isinstance(values[4], str)
        and isinstance(values[5], str)
    )


__all__ = ["CheckReport", "DamagedDatabase", "SalvageReport", "TableSalvage", "check", "salvage"]
