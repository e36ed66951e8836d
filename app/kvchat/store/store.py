"""The only place that speaks SQL: :class:`Store` is one SQLite file, its tables' queries
mixed in from one module per table family."""

from __future__ import annotations

import os
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import ensure_private_dir
from kvchat.store.connection import (
    DamagedDatabase,
    StoreFull,
    _translate,
    check_connection,
    damaged_message,
    now,
    read_only_uri,
)
from kvchat.store.documents_sql import DocumentsSql
from kvchat.store.drafts_sql import DraftsSql
from kvchat.store.figures_sql import FiguresSql
from kvchat.store.imports_sql import ImportsSql
from kvchat.store.locks import file_lock
from kvchat.store.messages_sql import MessagesSql
from kvchat.store.migrations import MIGRATIONS, migrate
from kvchat.store.server_slots import ServerSlotsSql
from kvchat.store.session_list_sql import SessionListSql
from kvchat.store.session_models import SessionModelsSql
from kvchat.store.sessions_sql import SessionsSql
from kvchat.store.snapshots_sql import SnapshotsSql
from kvchat.store.summaries_sql import SummariesSql
from kvchat.store.tools_sql import ToolsSql
from kvchat.store.versions_sql import VersionsSql
from kvchat.system import current as current_system

__all__ = ["DamagedDatabase", "Store", "StoreFull", "damaged_message", "now"]

# A file up to this size (with its WAL) gets SQLite's full integrity_check before it is
# opened for writing (tens of ms). A bigger one opens after the check of the tables in
# OPEN_CHECK_TABLES (what `kvchat list` and the first paint read) and gets the full check in
# the background; every write waits for that check's verdict (a damaged index is only seen
# by the full check: quick_check does not compare an index with its table), and a failed
# one stops every write.
FULL_CHECK_AT_OPEN_BYTES = 16 << 20
# The tables (with their indexes) a big file's open checks in full before it is used: the
# session list. ~1 ms per 1,000 sessions; the messages (most of the file) are checked in
# the background. Needs SQLite 3.33 (integrity_check of one table); older: background only.
OPEN_CHECK_TABLES: tuple[str, ...] = ("sessions",)
# And the messages' index, read alone (not the table), against what each session row
# records (its count and last id, kept by triggers): a damaged entry names another session
# or leaves one short. ~30 ms at 200,000 messages. When they disagree, the full check runs
# at open and decides (a count that is wrong on a sound file is not damage).
_MESSAGE_INDEX_AGREES = """
    SELECT count(*), coalesce(sum(bad), 0), coalesce(sum(n), 0),
           (SELECT total(n_messages) FROM sessions)
    FROM (
        SELECT m.n AS n,
               (s.id IS NULL OR s.n_messages != m.n OR s.last_message_id != m.last) AS bad
        FROM (
            SELECT session_id, count(*) AS n, max(id) AS last
            FROM messages INDEXED BY idx_messages_session_id_id GROUP BY session_id
        ) AS m LEFT JOIN sessions AS s ON s.id = m.session_id
    )
"""
# How many SQLite steps a background check runs between looks at whether to stop.
CHECK_STEPS = 100_000


def _create_private_file(path: Path) -> None:
    """Create ``path`` as 0600 before SQLite opens it; its -wal/-shm inherit the mode."""
    if path.exists():
        return
    fd = current_system().open_no_follow(path, os.O_CREAT | os.O_RDWR)
    os.close(fd)
    os.chmod(path, 0o600)


def _create_database(path: Path) -> list[str]:
    """Make a new database at ``path`` whole or not at all: built (WAL mode, migrated) under
    a temporary name, then renamed into place. So an empty ``kvchat.db`` is never one that
    kvchat was making: it is a file that lost its contents (see :func:`_keep_empty_aside`)."""
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}")
    for leftover in (tmp, *(tmp.with_name(tmp.name + s) for s in ("-wal", "-shm", "-journal"))):
        leftover.unlink(missing_ok=True)
    _create_private_file(tmp)
    try:
        conn = sqlite3.connect(tmp)
        try:
            _configure(conn, durable=False)
            applied = migrate(conn)
        finally:
            conn.close()  # the last connection: the WAL is folded in and removed
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return applied


def _configure(conn: sqlite3.Connection, *, durable: bool = True) -> None:
    """The connection's settings: WAL, and (for the store's own connection) full syncs and
    foreign keys. Recursive triggers are on as sqlite-utils, which the store used to open
    its connection through, sets them (a REPLACE then fires the delete triggers)."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA recursive_triggers=on")
    if durable:
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")


def _close_keeping_wal(conn: sqlite3.Connection, path: Path) -> None:
    """Close ``conn`` without checkpointing the WAL into a damaged file: a read-only
    connection holds a read lock meanwhile, so the closing one is not the last (and a
    read-only connection never checkpoints)."""
    try:
        reader = sqlite3.connect(read_only_uri(path), uri=True, timeout=1)
    except sqlite3.DatabaseError:
        conn.close()
        return
    try:
        reader.execute("BEGIN")
        reader.execute("PRAGMA schema_version").fetchone()  # the header only: a read lock
    except (sqlite3.DatabaseError, UnicodeDecodeError):
        pass
    finally:
        conn.close()
        reader.close()


def _keep_empty_aside(path: Path) -> None:
    """A 0-byte database (and no WAL holding pages for it) lost its conversations: rename
    it aside and say so, instead of quietly starting a new database in its place."""
    wal = path.with_name(path.name + "-wal")
    if path.stat().st_size != 0 or (wal.exists() and wal.stat().st_size > 0):
        return
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.empty-{stamp}")
    path.rename(aside)
    raise KvchatError(
        f"the database {path} is empty (0 bytes: whatever it held is gone); it is kept "
        f"aside as {aside.name}, and the next kvchat command starts a new database "
        "(put a backup in its place first to keep your conversations)"
    )


class Store(
    SessionsSql,
    SessionListSql,
    MessagesSql,
    VersionsSql,
    SnapshotsSql,
    ImportsSql,
    ServerSlotsSql,
    SessionModelsSql,
    DocumentsSql,
    DraftsSql,
    SummariesSql,
    ToolsSql,
    FiguresSql,
):
    """Sessions, messages and the KV snapshot index in one SQLite file (WAL).

    Opening checks the file on a read-only connection (SQLite's full ``integrity_check``
    for a file up to :data:`FULL_CHECK_AT_OPEN_BYTES`) and runs the migrations while
    holding an exclusive lock on ``<db>.lock``, so two processes opening a new home never
    race. A bigger file (a history of thousands of conversations) opens after a check of
    the session list's table and indexes only (:data:`OPEN_CHECK_TABLES`); its full check
    runs in the background, and every write waits for that check's verdict (before the
    migrations, when some are due, it runs at open). Reads do not wait. A damaged file
    raises :class:`DamagedDatabase` and is never written to: not even its WAL is
    checkpointed.
    """

    def __init__(self, path: Path, *, check: bool = True) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._damage = None
        self._checker: threading.Thread | None = None
        self._check_conn: sqlite3.Connection | None = None
        # Set once the file passed the check that gates writes (or found it damaged).
        self._checked = threading.Event()
        # Set by close(): a background check stops, however far it got (see _stop_check).
        self._stopping = threading.Event()
        ensure_private_dir(path.parent)
        background = False
        try:
            with file_lock(self.lock_path(path)):
                created = [] if path.exists() else _create_database(path)
                _keep_empty_aside(path)
                if check and (self._small() or self._migrations_due()):
                    self._check_read_only()
                    self._checked.set()
                elif check:
                    self._check_read_only(OPEN_CHECK_TABLES)
                    if self._message_index_agrees():
                        background = True  # the full check: writes wait for its verdict
                    else:
                        self._check_read_only()  # the full check decides, now
                        self._checked.set()
                else:
                    self._checked.set()
                # Whether the file passed the check that gates writes (so closing may fold
                # its WAL in): False until the background check says so.
                self._verified = self._checked.is_set()
                conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
                self.conn = conn
                try:
                    _configure(conn)
                    with self._lock:
                        self.applied_migrations = created + migrate(conn)
                except BaseException:
                    _close_keeping_wal(conn, path)  # a failed open changes nothing
                    raise
        except sqlite3.DatabaseError as exc:
            raise _translate(path, exc) from None
        except OSError as exc:
            raise KvchatError(f"cannot open the database {path}: {exc.strerror or exc}") from None
        if background:
            self._checker = threading.Thread(
                target=self._background_check, name="kvchat-integrity-check", daemon=True
            )
            self._checker.start()
        else:
            self._checked.set()

    @staticmethod
    def lock_path(path: Path) -> Path:
        return path.with_name(path.name + ".lock")

    def _small(self) -> bool:
        """Whether the file (with its WAL) is small enough for the full check at open."""
        size = self.path.stat().st_size
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists():
            size += wal.stat().st_size
        return size <= FULL_CHECK_AT_OPEN_BYTES

    def _migrations_due(self) -> bool:
        """Whether opening will migrate (write) the file: then it is checked first. A file
        whose migrations table can't be read counts as due (the check says why)."""
        try:
            conn = check_connection(self.path)
            try:
                done = {row[0] for row in conn.execute("SELECT name FROM _migrations")}
            finally:
                conn.close()
        except (sqlite3.DatabaseError, UnicodeDecodeError):
            return True
        return any(migration.__name__ not in done for migration in MIGRATIONS)

    def _check_read_only(self, tables: tuple[str, ...] | None = None) -> None:
        """Check the file before it is opened for writing: SQLite's full integrity check,
        or (``tables``) that of those tables and their indexes only. Raises DamagedDatabase
        (the file and its WAL untouched) when it fails."""
        if tables is None:
            pragmas = ["integrity_check(5)"]
        elif sqlite3.sqlite_version_info >= (3, 33):
            pragmas = [f"integrity_check({table})" for table in tables]
        else:  # integrity_check(N) would read a table's name as N: the whole file
            return
        result = ["ok"]
        conn = check_connection(self.path)
        try:
            for pragma in pragmas:
                result = [row[0] for row in conn.execute(f"PRAGMA {pragma}").fetchall()]
                if result != ["ok"]:
                    break
        except UnicodeDecodeError:  # SQLite's message quotes damaged bytes
            result = ["SQLite's report of the damage is not even text"]
        finally:
            conn.close()
        if result != ["ok"]:
            raise DamagedDatabase(damaged_message(self.path, "; ".join(map(str, result[:3]))))

    def _message_index_agrees(self) -> bool:
        """Whether the messages' index agrees with the counts the session rows record (True
        also where it cannot tell: the full check in the background decides then)."""
        conn = check_connection(self.path)
        try:
            _, bad, indexed, recorded = conn.execute(_MESSAGE_INDEX_AGREES).fetchone()
        except sqlite3.OperationalError as exc:
            return "no such" in str(exc)  # an older schema; "malformed": check it all now
        except (sqlite3.DatabaseError, UnicodeDecodeError):
            return False
        finally:
            conn.close()
        return bad == 0 and indexed == recorded

    def _background_check(self) -> None:
        """The full ``integrity_check`` of a big file, on a read-only connection (a
        background thread). Writes wait for its verdict: ``quick_check`` alone would let
        them into a file whose index disagrees with its table (it does not compare them),
        and a write through such an index lands where a read cannot find it. Damage stops
        every later write."""
        try:
            if self._pragma_ok("integrity_check(5)"):
                self._verified = True
        except sqlite3.DatabaseError as exc:
            if "interrupt" not in str(exc):
                self._found_damage(str(exc))
        except UnicodeDecodeError:
            self._found_damage("SQLite's report of the damage is not even text")
        finally:
            self._checked.set()  # writes go on, or are refused for the damage

    def _pragma_ok(self, pragma: str) -> bool:
        """Run a check pragma on a read-only connection; False (damage recorded) if it fails."""
        conn = check_connection(self.path)
        conn.set_progress_handler(self._stop_check, CHECK_STEPS)
        self._check_conn = conn
        try:
            result = [row[0] for row in conn.execute(f"PRAGMA {pragma}").fetchall()]
        finally:
            self._check_conn = None
            conn.close()
        if result != ["ok"]:
            self._found_damage("; ".join(map(str, result[:3])))
            return False
        return True

    def _stop_check(self) -> int:
        """SQLite's progress handler on the check's connection: non-zero ends the statement
        ("interrupted") once close() was called. Unlike ``interrupt()``, it also stops a
        check that starts just after close() looked, which a short command (``kvchat
        list`` on a big file) otherwise waits up to 5 s for."""
        return 1 if self._stopping.is_set() else 0

    def wait_for_check(self, timeout: float | None = None) -> str | None:
        """Wait for the background integrity check (if one runs); the damage it found."""
        if self._checker is not None:
            self._checker.join(timeout)
        return self._damage

    def close(self) -> None:
        self._stopping.set()
        checker, conn = self._checker, self._check_conn
        if checker is not None and checker.is_alive():
            if conn is not None:
                conn.interrupt()
            checker.join(5)
        # Under the lock: a query another thread is running finishes first (closing the
        # connection under a running query crashes the process), later ones are refused.
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._damage is None and self._verified:
                self.conn.close()
            else:
                _close_keeping_wal(self.conn, self.path)

    def integrity_check(self) -> str:
        return str(self._rows("PRAGMA integrity_check")[0]["integrity_check"])
