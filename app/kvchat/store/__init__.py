"""SQLite storage: the conversation text (the source of truth) and the snapshot index."""

from kvchat.store.rows import (
    ChunkRow,
    Message,
    MessageWindow,
    SearchHit,
    Session,
    SessionChanges,
    SessionPage,
    SessionSummary,
    SnapshotRow,
)
from kvchat.store.store import Store

__all__ = [
    "ChunkRow",
    "Message",
    "MessageWindow",
    "SearchHit",
    "Session",
    "SessionChanges",
    "SessionPage",
    "SessionSummary",
    "SnapshotRow",
    "Store",
]
