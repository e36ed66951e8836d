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
from kvchat.store.imports_sql import ImportsSql
from kvchat.store.locks import file_lock
from kvchat.store.messages_sql import MessagesSql
from kvchat.store.migrations import MIGRATIONS, migrate
from kvchat.store.server_slots import ServerSlotsSql
from kvchat.store.session_list_sql import SessionListSql
from kvchat.store.session_models import SessionModelsSql
from kvchat.store.sessions_sql import SessionsSql
from kvchat.store.snapshots_sql import SnapshotsSql
from kvchat.store.versions_sql import VersionsSql

__all__ = ["DamagedDatabase", "Store", "StoreFull", "damaged_message", "now"]

# A file up to this size (with its WAL) gets SQLite's full integrity_check before it is
# opened for writing (tens of ms); a bigger one a quick_check then, and the full check in
# the background, which stops every write when it fails.
FULL_CHECK_AT_OPEN_BYTES = 16 << 20
# How many SQLite steps a background check runs between looks at whether to stop.
CHECK_STEPS = 100_000


def _create_private_file(path: Path) -> None:
    """Create ``path`` as 0600 before SQLite opens it; its -wal/-shm inherit the mode."""
    if path.exists():
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
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
):
    """Sessions, messages and the KV snapshot index in one SQLite file (WAL).

    Opening checks the file on a read-only connection (SQLite's full ``integrity_check``
    for a file up to :data:`FULL_CHECK_AT_OPEN_BYTES`) and runs the migrations while
    holding an exclusive lock on ``<db>.lock``, so two processes opening a new home never
    race. A bigger file (a history of thousands of conversations) opens at once: its
    ``quick_check`` (which reads the whole file) and then the full check run in the
    background, and every write waits for the quick check (before the migrations, when
    some are due, it runs at open). A damaged file raises :class:`DamagedDatabase` and is
    never written to: not even its WAL is checkpointed.
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
                    background = not self._check_read_only()
                    self._checked.set()
                elif check:
                    background = True  # the quick check too: writes wait for it
                else:
                    self._checked.set()
                # Whether the file passed the check that gates writes (so closing may fold
                # its WAL in): False until a background quick check says so.
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

    def _check_read_only(self) -> bool:
        """Check the file before it is opened for writing; True when the check was the full
        one. Raises DamagedDatabase (the file and its WAL untouched) when it fails."""
        full = self._small()
        conn = check_connection(self.path)
        try:
            pragma = "integrity_check(5)" if full else "quick_check(5)"
            result = [row[0] for row in conn.execute(f"PRAGMA {pragma}").fetchall()]
        except UnicodeDecodeError:  # SQLite's message quotes damaged bytes
            result = ["SQLite's report of the damage is not even text"]
        finally:
            conn.close()
        if result != ["ok"]:
            raise DamagedDatabase(damaged_message(self.path, "; ".join(map(str, result[:3]))))
        return full

    def _background_check(self) -> None:
        """The checks of a big file, on a read-only connection (a background thread): first
        ``quick_check`` when it did not run at open (writes wait for it), then the full
        ``integrity_check``. Damage either finds (the full one also sees an index that
        disagrees with its table) stops every later write."""
        try:
            if not self._checked.is_set():
                try:
                    if not self._pragma_ok("quick_check(5)"):
                        return
                    self._verified = True
                finally:
                    self._checked.set()  # writes go on, or are refused for the damage
            self._pragma_ok("integrity_check(5)")
        except sqlite3.DatabaseError as exc:
            if "interrupt" not in str(exc):
                self._found_damage(str(exc))
        except UnicodeDecodeError:
            self._found_damage("SQLite's report of the damage is not even text")

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
