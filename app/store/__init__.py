"""SQLite storage: the conversation text (the source of truth) and the snapshot index."""

from app.store.models import ChunkRow, Message, SearchHit, Session, SessionSummary, SnapshotRow
from app.store.store import Store

__all__ = ["ChunkRow", "Message", "SearchHit", "Session", "SessionSummary", "SnapshotRow", "Store"]
