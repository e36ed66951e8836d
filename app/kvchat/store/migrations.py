"""Ordered, named schema migrations; each runs once and is recorded in ``_migrations``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import sqlite_utils

Migration = Callable[[sqlite_utils.Database], None]


def m001_sessions_and_messages(db: sqlite_utils.Database) -> None:
    db["sessions"].create(
        {
            "id": str,
            "title": str,
            "system_prompt": str,
            "settings": str,
            "created": str,
            "updated": str,
        },
        pk="id",
        not_null={"title", "settings", "created", "updated"},
        defaults={"settings": "{}"},
        if_not_exists=True,
    )
    db["messages"].create(
        {
            "id": int,
            "session_id": str,
            "role": str,
            "content": str,
            "created": str,
            "token_count": int,
            "partial": int,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
        not_null={"session_id", "role", "content", "created"},
        defaults={"token_count": 0, "partial": 0},
        if_not_exists=True,
    )
    db["messages"].create_index(["session_id", "id"], if_not_exists=True)
    db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)


def m002_message_search(db: sqlite_utils.Database) -> None:
    db["messages"].enable_fts(["content"], tokenize="porter", create_triggers=True, replace=True)


def m003_kv_snapshots(db: sqlite_utils.Database) -> None:
    db["kv_snapshots"].create(
        {
            "session_id": str,
            "path": str,
            "n_tokens": int,
            "token_ids": bytes,
            "model_id": str,
            "llama_cpp_version": str,
            "type_k": str,
            "type_v": str,
            "flash_attn": int,
            "rope_freq_base": float,
            "rope_freq_scale": float,
            "n_swa": int,
            "fingerprint": str,
            "n_bytes": int,
            "checksum": str,
            "created": str,
            "last_used": str,
        },
        pk="session_id",
        foreign_keys=[("session_id", "sessions", "id")],
        not_null={"path", "n_tokens", "token_ids", "fingerprint", "n_bytes", "checksum"},
        if_not_exists=True,
    )


def m004_kv_chunks(db: sqlite_utils.Database) -> None:
    """Chunked snapshots: content-addressed token-range chunks shared between sessions."""
    db["kv_chunks"].create(
        {
            "key": str,
            "path": str,
            "start": int,
            "n_tokens": int,
            "n_bytes": int,
            "checksum": str,
            "created": str,
            "last_used": str,
        },
        pk="key",
        not_null={"path", "start", "n_tokens", "n_bytes", "checksum"},
        if_not_exists=True,
    )
    snapshots = db["kv_snapshots"]
    columns = set(snapshots.columns_dict)
    if "format" not in columns:
        snapshots.add_column("format", str, not_null_default="blob")
    if "chunk_keys" not in columns:
        snapshots.add_column("chunk_keys", str)
    if "layout" not in columns:
        snapshots.add_column("layout", str)


def m005_window_checkpoints(db: sqlite_utils.Database) -> None:
    """Sliding-window models: a snapshot lists the pieces of window cells it keeps for
    branch points, ``[[start, end, key], …]`` as JSON. A piece's file and row are a chunk's
    (kv_chunks), keyed like one."""
    snapshots = db["kv_snapshots"]
    if "checkpoints" not in set(snapshots.columns_dict):
        snapshots.add_column("checkpoints", str)


def m006_reply_versions(db: sqlite_utils.Database) -> None:
    """Reply versions: every version of a regenerated reply, numbered from 1; the message
    row holds the current one and ``messages.version`` says which (see versions_sql)."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS reply_versions (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            n INTEGER NOT NULL,
            content TEXT NOT NULL,
            token_count INTEGER NOT NULL DEFAULT 0,
            partial INTEGER NOT NULL DEFAULT 0,
            created TEXT NOT NULL,
            PRIMARY KEY (message_id, n)
        )
        """
    )
    if "version" not in set(db["messages"].columns_dict):
        db["messages"].add_column("version", int)


def m007_server_slots(db: sqlite_utils.Database) -> None:
    """llama-server engine: per session, the slot file kvchat named, its exact token ids
    and the fingerprint of the server that wrote it (see kvchat.kvcache.server_tiers)."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS server_slots (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            filename TEXT NOT NULL,
            n_tokens INTEGER NOT NULL,
            token_ids BLOB NOT NULL,
            fingerprint TEXT NOT NULL,
            n_bytes INTEGER NOT NULL DEFAULT 0,
            generation INTEGER NOT NULL DEFAULT 0,
            created TEXT,
            last_used TEXT
        )
        """
    )


def m008_session_model(db: sqlite_utils.Database) -> None:
    """The model each session last ran with (see kvchat.store.session_models)."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS session_models (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            model_path TEXT NOT NULL,
            model_name TEXT NOT NULL,
            updated TEXT NOT NULL
        )
        """
    )


def m009_snapshot_shelf(db: sqlite_utils.Database) -> None:
    """Snapshots kept per setting: a session's earlier snapshot that a save of another
    setting (n_ctx window, KV types, ...) did not continue stays here, one per fingerprint,
    with the columns of ``kv_snapshots`` (see SnapshotsSql.shelved_snapshots)."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS kv_snapshot_shelf (
            session_id TEXT NOT NULL REFERENCES sessions(id),
            shelf_key TEXT NOT NULL,
            path TEXT NOT NULL,
            n_tokens INTEGER NOT NULL,
            token_ids BLOB NOT NULL,
            model_id TEXT,
            llama_cpp_version TEXT,
            type_k TEXT,
            type_v TEXT,
            flash_attn INTEGER,
            rope_freq_base FLOAT,
            rope_freq_scale FLOAT,
            n_swa INTEGER,
            fingerprint TEXT NOT NULL,
            n_bytes INTEGER NOT NULL,
            checksum TEXT NOT NULL,
            created TEXT,
            last_used TEXT,
            format TEXT NOT NULL DEFAULT 'blob',
            chunk_keys TEXT,
            layout TEXT,
            checkpoints TEXT,
            PRIMARY KEY (session_id, shelf_key)
        )
        """
    )


def m010_session_parent(db: sqlite_utils.Database) -> None:
    """Branch view: the session a fork or an edit was made from (NULL for a session made
    new or imported). Deleting a parent hands its branches to the grandparent (or NULL)."""
    if "parent_id" not in set(db["sessions"].columns_dict):
        db["sessions"].add_column("parent_id", str)


def m012_message_finish_reason(db: sqlite_utils.Database) -> None:
    """Why each reply ended ("stop", "length": cut at the token limit, "cancelled",
    "context"), on the message and on each of its versions; NULL for your messages and for
    replies stored before this (and a reply still streaming)."""
    for table in ("messages", "reply_versions"):
        if "finish_reason" not in set(db[table].columns_dict):
            db[table].add_column("finish_reason", str)


def m013_session_counts(db: sqlite_utils.Database) -> None:
    """Each session row records its message count, last message id and token sum, kept by
    triggers on ``messages``; a session whose messages read otherwise (a damaged index
    hides some) is damage, and nothing is written to it (see SessionsSql.check_counts)."""
    columns = set(db["sessions"].columns_dict)
    for name in ("n_messages", "last_message_id", "n_tokens"):
        if name not in columns:
            db.execute(f"ALTER TABLE sessions ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0")
    db.execute(
        """
        UPDATE sessions SET
            n_messages = (SELECT COUNT(*) FROM messages m WHERE m.session_id = sessions.id),
            last_message_id = (SELECT COALESCE(MAX(m.id), 0) FROM messages m
                               WHERE m.session_id = sessions.id),
            n_tokens = (SELECT COALESCE(SUM(m.token_count), 0) FROM messages m
                        WHERE m.session_id = sessions.id)
        """
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS messages_count_insert AFTER INSERT ON messages BEGIN
            UPDATE sessions SET n_messages = n_messages + 1,
                last_message_id = MAX(last_message_id, NEW.id),
                n_tokens = n_tokens + COALESCE(NEW.token_count, 0)
            WHERE id = NEW.session_id;
        END
        """
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS messages_count_delete AFTER DELETE ON messages BEGIN
            UPDATE sessions SET n_messages = n_messages - 1,
                n_tokens = n_tokens - COALESCE(OLD.token_count, 0),
                last_message_id = CASE WHEN last_message_id = OLD.id
                    THEN (SELECT COALESCE(MAX(id), 0) FROM messages
                          WHERE session_id = OLD.session_id)
                    ELSE last_message_id END
            WHERE id = OLD.session_id;
        END
        """
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS messages_count_update
        AFTER UPDATE OF token_count, session_id ON messages BEGIN
            UPDATE sessions SET n_messages = n_messages - 1,
                n_tokens = n_tokens - COALESCE(OLD.token_count, 0),
                last_message_id = CASE WHEN last_message_id = OLD.id
                    THEN (SELECT COALESCE(MAX(id), 0) FROM messages
                          WHERE session_id = OLD.session_id)
                    ELSE last_message_id END
            WHERE id = OLD.session_id;
            UPDATE sessions SET n_messages = n_messages + 1,
                last_message_id = MAX(last_message_id, NEW.id),
                n_tokens = n_tokens + COALESCE(NEW.token_count, 0)
            WHERE id = NEW.session_id;
        END
        """
    )


MIGRATIONS: list[Migration] = [
    m001_sessions_and_messages,
    m002_message_search,
    m003_kv_snapshots,
    m004_kv_chunks,
    m005_window_checkpoints,
    m006_reply_versions,
    m007_server_slots,
    m008_session_model,
    m009_snapshot_shelf,
    m010_session_parent,
    m012_message_finish_reason,
    m013_session_counts,
]


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now.

    Each migration is idempotent (``if_not_exists`` / ``replace``), so one interrupted
    before it was recorded simply runs again.
    """
    table = db["_migrations"]
    if not table.exists():
        db["_migrations"].create({"name": str, "applied": str}, pk="name")
    done = {row["name"] for row in db["_migrations"].rows}
    applied: list[str] = []
    for migration in MIGRATIONS:
        name = migration.__name__
        if name in done:
            continue
        migration(db)
        with db.conn:
            db["_migrations"].insert({"name": name, "applied": datetime.now(UTC).isoformat()})
        applied.append(name)
    return applied
