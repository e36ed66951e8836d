"""The only place that speaks SQL: :class:`Store` is one SQLite file, its tables' queries
mixed in from one module per table family."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import sqlite_utils

from kvchat.config import ensure_private_dir
from kvchat.errors import KvchatError
from kvchat.store.base import (
    DamagedDatabase,
    StoreFull,
    _translate,
    damaged_message,
    now,
)
from kvchat.store.imports_sql import ImportsSql
from kvchat.store.locks import file_lock
from kvchat.store.messages_sql import MessagesSql
from kvchat.store.migrations import migrate
from kvchat.store.server_slots import ServerSlotsSql
from kvchat.store.session_models import SessionModelsSql
from kvchat.store.sessions_sql import SessionsSql
from kvchat.store.snapshots_sql import SnapshotsSql
from kvchat.store.versions_sql import VersionsSql

__all__ = ["DamagedDatabase", "Store", "StoreFull", "damaged_message", "now"]


def _create_private_file(path: Path) -> None:
    """Create ``path`` as 0600 before SQLite opens it; its -wal/-shm inherit the mode."""
    if path.exists():
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


class Store(
    SessionsSql,
    MessagesSql,
    VersionsSql,
    SnapshotsSql,
    ImportsSql,
    ServerSlotsSql,
    SessionModelsSql,
):
    """Sessions, messages and the KV snapshot index in one SQLite file (WAL).

    Opening checks the file (``PRAGMA quick_check``) and runs the migrations while holding
    an exclusive lock on ``<db>.lock``, so two processes opening a new home never race.
    A damaged file raises :class:`DamagedDatabase` and is never written to.
    """

    def __init__(self, path: Path, *, check: bool = True) -> None:
        self.path = path
        self._lock = threading.RLock()
        ensure_private_dir(path.parent)
        try:
            with file_lock(self.lock_path(path)):
                _create_private_file(path)
                conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
                self.db = sqlite_utils.Database(conn)
                try:
                    if check:
                        self._quick_check()
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=FULL")
                    self.db.execute("PRAGMA foreign_keys=ON")
                    with self._lock:
                        self.applied_migrations = migrate(self.db)
                except BaseException:
                    conn.close()
                    raise
        except sqlite3.DatabaseError as exc:
            raise _translate(path, exc) from None
        except OSError as exc:
            raise KvchatError(f"cannot open the database {path}: {exc.strerror or exc}") from None

    @staticmethod
    def lock_path(path: Path) -> Path:
        return path.with_name(path.name + ".lock")

    def _quick_check(self) -> None:
        result = [row[0] for row in self.db.execute("PRAGMA quick_check").fetchall()]
        if result != ["ok"]:
            raise DamagedDatabase(damaged_message(self.path, "; ".join(map(str, result[:3]))))

    def close(self) -> None:
        self.db.conn.close()

    def integrity_check(self) -> str:
        return str(self._rows("PRAGMA integrity_check")[0]["integrity_check"])
