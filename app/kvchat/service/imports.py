"""What ``kvchat import`` and ``kvchat export --format bundle`` need of the store, and nothing more: the service's one
door for :mod:`kvchat.transfer`, which never reaches the store itself."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvchat.store import Session, Store


@dataclass(frozen=True)
class StoredSession:
    """A session already in the store, as an import reports it: its row, how many messages
    it holds, and the tokens of its saved KV (0: none)."""

    session: Session
    messages: int
    kv_tokens: int


class ImportLedger:
    """Sessions stored from a file in one transaction, and the record of which file they
    came from (``meta`` key → session ids), over ``store``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def store_sessions(
        self, sessions: Iterable[dict[str, Any]], file_key: str
    ) -> list[tuple[str, bool]]:
        """Insert whole sessions in one transaction (all or nothing) and record them under
        ``file_key``: (session id, whether it is new) per session, in order."""
        return self.store.import_sessions(sessions, file_key)

    def claimed(self, file_key: str) -> list[str]:
        """The sessions an earlier import of the file ``file_key`` names that still exist."""
        return self.store.claimed_sessions(file_key)

    def session(self, session_id: str) -> Session:
        """The session ``session_id``'s row (a KvchatError if there is none)."""
        return self.store.get_session(session_id)

    def stored(self, session_id: str) -> StoredSession:
        """The session ``session_id`` (a KvchatError if there is none), its message count
        (one row read) and the tokens its saved KV holds."""
        row = self.store.get_snapshot(session_id)
        return StoredSession(
            self.store.get_session(session_id),
            self.store.message_count(session_id),
            row.n_tokens if row is not None else 0,
        )
