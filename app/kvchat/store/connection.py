"""What every part of the store shares: the connection, transactions, and SQLite's errors
translated into one clear line."""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError

# Free space below which a disk counts as full (SQLite needs a few pages to open a file).
FULL_BELOW_BYTES = 64 * 1024


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class DamagedDatabase(KvchatError):
    """The database file fails SQLite's checks: kvchat refuses to write to it."""


class StoreFull(KvchatError):
    """The disk is full: SQLite could not commit."""


def damaged_message(path: Path, detail: str) -> str:
    return (
        f"the database {path} is damaged ({detail}); nothing was written to it. "
        "Run `kvchat doctor` to move it aside and salvage the text into a fresh database"
    )


def read_only_uri(path: Path) -> str:
    """An SQLite URI opening ``path`` read-only: nothing is written to the file or its WAL
    (a read-only connection never checkpoints), whatever SQLite finds in it."""
    return f"file:{urllib.parse.quote(str(path))}?mode=ro"


def check_connection(path: Path, timeout: float = 30) -> sqlite3.Connection:
    """A read-only connection for checking ``path``: what SQLite says of a damaged file may
    quote bytes that are not UTF-8, so its text is decoded leniently (never a traceback)."""
    conn = sqlite3.connect(read_only_uri(path), uri=True, timeout=timeout, check_same_thread=False)
    conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
    return conn


def _translate(path: Path, exc: sqlite3.DatabaseError) -> Exception:
    """One clear line for what SQLite raises on a full disk, a busy or a damaged file.

    Anything else (a constraint violation: a bug, not the user's problem) stays as it is.
    """
    text = str(exc)
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return exc
    if "full" in text or ("disk I/O error" in text and disk_full(path.parent)):
        # SQLite reports a full disk as an I/O error when a page or its -shm can't grow.
        return StoreFull(f"the disk is full: could not write to {path} ({text})")
    if "locked" in text or "busy" in text:
        return KvchatError(f"the database {path} is busy (another kvchat is writing): {text}")
    if any(sign in text for sign in ("malformed", "not a database", "encrypted", "decode")):
        # "Could not decode to UTF-8": a byte of stored text changed on disk
        return DamagedDatabase(damaged_message(path, text))
    return KvchatError(f"database error in {path}: {text}")


def disk_full(directory: Path) -> bool:
    """Whether the filesystem holding ``directory`` (or its nearest parent) has no room."""
    for place in (directory, *directory.parents):
        try:
            stat = os.statvfs(place)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize < FULL_BELOW_BYTES
    return False


class SqlBase:
    """The connection and the two ways the store's parts use it (a transaction, a query).

    Once any check finds the file damaged (``_found_damage``), every later transaction is
    refused with the same line: nothing more is written to a damaged database.
    """

    path: Path
    conn: sqlite3.Connection  # plain sqlite3: sqlite-utils only for migrations
    _lock: threading.RLock
    _damage: str | None = None
    # Set (under the lock) when the store is closed: a read or write still queued on another
    # thread then gets a clear error, never a closed connection (a query racing sqlite3's
    # close crashes the process).
    _closed: bool = False
    # Set once the check that gates writes is done (a big file's runs in the background).
    _checked: threading.Event | None = None
    # Whether that check passed (False: it still runs, or it stopped without a verdict).
    _verified: bool = True

    def _refuse_if_damaged(self) -> None:
        """Raise :class:`DamagedDatabase` when a check found the file damaged (waiting for
        the check that gates writes, when it still runs: a big file's full check, in the
        background). A check that stopped without a verdict (the store is closing) lets no
        write through either."""
        if self._checked is not None:
            self._checked.wait()
        if self._damage is not None:
            raise DamagedDatabase(damaged_message(self.path, self._damage))
        if not self._verified:
            raise KvchatError(
                f"the database {self.path} is closing before its check ended; nothing was written"
            )

    def _found_damage(self, detail: str) -> DamagedDatabase:
        """Record damage (no more writes) and return the error that says so."""
        if self._damage is None:
            self._damage = detail
        return DamagedDatabase(damaged_message(self.path, detail))

    def _open_conn(self) -> sqlite3.Connection:
        """The connection, to be used while holding the lock; raises once the store is closed."""
        if self._closed:
            raise KvchatError(f"the database {self.path} is closed")
        return self.conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._refuse_if_damaged()
        try:
            with self._lock, self._open_conn() as conn:
                yield conn
        except sqlite3.DatabaseError as exc:
            error = _translate(self.path, exc)
            if isinstance(error, DamagedDatabase):
                self._damage = self._damage or str(exc)
            raise error from None
        except UnicodeDecodeError:  # SQLite's message about a damaged file quotes its bytes
            raise self._found_damage("SQLite's report of the damage is not even text") from None

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """Hold the connection for reads that must see one moment (one read transaction,
        unless the caller's is open); SQLite's errors as one clear line."""
        try:
            with self._lock:
                conn = self._open_conn()
                began = not conn.in_transaction
                if began:
                    conn.execute("BEGIN")
                try:
                    yield conn
                finally:
                    if began:
                        conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise _translate(self.path, exc) from None

    def _rows(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[dict[str, Any]]:
        try:
            with self._lock:
                cursor = self._open_conn().execute(sql, params)
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row)) for row in cursor.fetchall()]
        except sqlite3.DatabaseError as exc:
            raise _translate(self.path, exc) from None
        except UnicodeDecodeError:
            raise self._found_damage("SQLite's report of the damage is not even text") from None
