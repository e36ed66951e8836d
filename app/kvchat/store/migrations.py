"""Ordered, named schema migrations; each runs once and is recorded in ``_migrations``.

sqlite-utils (whose import pulls in numpy: ~0.2 s) is imported only when a migration is
due: what is applied is read with plain SQL first.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite_utils

Migration = Callable[["sqlite_utils.Database"], None]


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


# What bumps a session's change stamp: every column the session list shows or sorts by
# (a message added or edited moves ``updated``, so it counts too).
_CHANGE_COLUMNS = "title, system_prompt, settings, updated, parent_id"
_STAMP_SESSION = """
    UPDATE change_clock SET n = n + 1 WHERE id = 1;
    UPDATE sessions SET changed = (SELECT n FROM change_clock WHERE id = 1)
    WHERE rowid = NEW.rowid;
"""


def m014_session_list_at_scale(db: sqlite_utils.Database) -> None:
    """Thousands of sessions (issue 26): the list reads a page at a time on an index of
    ``updated`` (keyset pagination), filters titles through a trigram full-text index, and
    a watcher reads what changed since its last look in one indexed query: every session
    row carries ``changed``, a stamp from one counter (``change_clock``) that its triggers
    bump on insert and on a change of what the list shows; a deleted session leaves its id
    and stamp in ``sessions_deleted``. Imported sessions keep their old ``updated`` times,
    so only the stamp says they are new."""
    if "changed" not in set(db["sessions"].columns_dict):
        db.execute("ALTER TABLE sessions ADD COLUMN changed INTEGER NOT NULL DEFAULT 0")
    db.execute(
        "CREATE TABLE IF NOT EXISTS change_clock"
        " (id INTEGER PRIMARY KEY CHECK (id = 1), n INTEGER NOT NULL)"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS sessions_deleted"
        " (id TEXT PRIMARY KEY, changed INTEGER NOT NULL)"
    )
    db.execute("CREATE INDEX IF NOT EXISTS sessions_by_updated ON sessions(updated)")
    db.execute("CREATE INDEX IF NOT EXISTS sessions_by_changed ON sessions(changed)")
    db.execute(
        "CREATE INDEX IF NOT EXISTS sessions_deleted_by_changed ON sessions_deleted(changed)"
    )
    with db.conn:
        db.execute("UPDATE sessions SET changed = rowid")
        db.execute(
            "INSERT OR REPLACE INTO change_clock (id, n)"
            " VALUES (1, (SELECT COALESCE(MAX(changed), 0) FROM sessions))"
        )
    db.execute(
        f"CREATE TRIGGER IF NOT EXISTS sessions_stamp_insert AFTER INSERT ON sessions BEGIN"
        f" {_STAMP_SESSION} DELETE FROM sessions_deleted WHERE id = NEW.id; END"
    )
    db.execute(
        f"CREATE TRIGGER IF NOT EXISTS sessions_stamp_update"
        f" AFTER UPDATE OF {_CHANGE_COLUMNS} ON sessions BEGIN {_STAMP_SESSION} END"
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS sessions_stamp_delete AFTER DELETE ON sessions BEGIN
            UPDATE change_clock SET n = n + 1 WHERE id = 1;
            INSERT OR REPLACE INTO sessions_deleted (id, changed)
            VALUES (OLD.id, (SELECT n FROM change_clock WHERE id = 1));
        END
        """
    )
    # Titles: a trigram index answers "contains these letters" (3 or more) from the index.
    db.execute(
        "CREATE VIRTUAL TABLE IF NOT EXISTS sessions_title_fts USING fts5"
        "(title, content='sessions', content_rowid='rowid', tokenize='trigram')"
    )
    db.execute("INSERT INTO sessions_title_fts(sessions_title_fts) VALUES ('rebuild')")
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS sessions_title_fts_insert AFTER INSERT ON sessions BEGIN
            INSERT INTO sessions_title_fts (rowid, title) VALUES (NEW.rowid, NEW.title);
        END
        """
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS sessions_title_fts_delete AFTER DELETE ON sessions BEGIN
            INSERT INTO sessions_title_fts (sessions_title_fts, rowid, title)
            VALUES ('delete', OLD.rowid, OLD.title);
        END
        """
    )
    db.execute(
        """
        CREATE TRIGGER IF NOT EXISTS sessions_title_fts_update AFTER UPDATE OF title ON sessions
        BEGIN
            INSERT INTO sessions_title_fts (sessions_title_fts, rowid, title)
            VALUES ('delete', OLD.rowid, OLD.title);
            INSERT INTO sessions_title_fts (rowid, title) VALUES (NEW.rowid, NEW.title);
        END
        """
    )


def m015_server_slot_checks(db: sqlite_utils.Database) -> None:
    """llama-server slot files kvchat can vouch for (issue 27): the file's xxh3 checksum as
    saved (NULL where the server's directory is not readable here), how many of its tokens
    hold a full prefill's KV (NULL: saved before this was counted), and why a file is never
    restored again (a restore of it broke the server's connection)."""
    columns = set(db["server_slots"].columns_dict)
    for name, kind in (("checksum", str), ("n_exact", int), ("quarantined", str)):
        if name not in columns:
            db["server_slots"].add_column(name, kind)


def m016_message_reasoning(db: sqlite_utils.Database) -> None:
    """A thinking model's reasoning, kept apart from the answer, on the message and on each
    of its versions ("" where there was none; not in the search index: the answer is what
    a search finds)."""
    for table in ("messages", "reply_versions"):
        if "reasoning" not in set(db[table].columns_dict):
            db.execute(f"ALTER TABLE {table} ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")


def m017_server_slot_kv_check(db: sqlite_utils.Database) -> None:
    """What vouches for a llama-server slot file where kvchat cannot read the server's
    slot directory (issue 37): the next-token log-probabilities the saved KV gave, as JSON
    (NULL where the file was checksummed instead, or saved before this was recorded)."""
    if "kv_check" not in set(db["server_slots"].columns_dict):
        db["server_slots"].add_column("kv_check", str)


def m018_documents(db: sqlite_utils.Database) -> None:
    """Documents given to conversations (attachments) and the library that keeps them
    (see :mod:`kvchat.store.documents_sql`): the extracted text is the truth; which
    session uses which, at its start (message_id -1) or with one of its messages."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS documents (id TEXT PRIMARY KEY, name TEXT NOT NULL,"
        " kind TEXT NOT NULL, size INTEGER NOT NULL, sha256 TEXT NOT NULL, text TEXT NOT NULL,"
        " pages INTEGER, source TEXT NOT NULL DEFAULT '', added TEXT NOT NULL,"
        " in_library INTEGER NOT NULL DEFAULT 0)"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS session_documents (session_id TEXT NOT NULL,"
        " document_id TEXT NOT NULL, message_id INTEGER NOT NULL, position INTEGER NOT NULL,"
        " PRIMARY KEY (session_id, message_id, document_id))"
    )
    db.execute(
        "CREATE INDEX IF NOT EXISTS session_documents_by_document"
        " ON session_documents (document_id)"
    )


def m019_library_readings(db: sqlite_utils.Database) -> None:
    """The readings the document library keeps (``kvchat docs add``): which reading (a
    hidden session's snapshot) holds a library document's KV, for which model and KV type,
    and how many tokens; a reading listed here is exempt from the disk budget's eviction
    while its document stays in the library."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS library_readings (document_id TEXT NOT NULL,"
        " reading_id TEXT NOT NULL, model TEXT NOT NULL, kv_type TEXT NOT NULL,"
        " tokens INTEGER NOT NULL, read_at TEXT NOT NULL,"
        " PRIMARY KEY (document_id, reading_id))"
    )


def m020_drafts(db: sqlite_utils.Database) -> None:
    """What is typed in each session's input and not sent yet (see
    :mod:`kvchat.store.drafts_sql`): kept as it is typed, so a kill loses none of it."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS drafts (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            text TEXT NOT NULL,
            updated TEXT NOT NULL
        )
        """
    )


def m021_tool_messages(db: sqlite_utils.Database) -> None:
    """Tool calls and their results (issue 43; see :mod:`kvchat.store.tools_sql`): the calls
    an assistant message made (its text keeps them as the model wrote them), and for each
    message of role "tool" the tool's qualified name, the call's id and arguments (JSON),
    whether the tool said it failed or its result was cut, and the whole result (the
    message's content is what the model read). Gone with the message."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS tool_calls (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            call_id TEXT NOT NULL,
            name TEXT NOT NULL,
            arguments TEXT NOT NULL,
            PRIMARY KEY (message_id, position)
        )
        """
    )
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS tool_messages (
            message_id INTEGER PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
            name TEXT NOT NULL,
            call_id TEXT NOT NULL,
            arguments TEXT NOT NULL,
            is_error INTEGER NOT NULL DEFAULT 0,
            truncated INTEGER NOT NULL DEFAULT 0,
            full_text TEXT NOT NULL,
            seconds REAL
        )
        """
    )


def m022_compaction(db: sqlite_utils.Database) -> None:
    """Compaction summaries (see :mod:`kvchat.store.summaries_sql`): a session's summary
    of its messages up to ``upto_message_id``, which the model reads instead of them. The
    messages stay; the newest row of a session is the one its prompts use."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS summaries (
            id INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            upto_message_id INTEGER NOT NULL,
            text TEXT NOT NULL,
            replaced_tokens INTEGER NOT NULL,
            created TEXT NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX IF NOT EXISTS idx_summaries_session ON summaries(session_id, id)")


def m023_session_pins_tags(db: sqlite_utils.Database) -> None:
    """Finding sessions among thousands (issue 41, item 7): a session may be pinned (listed
    first) and carry tags (lowercase words, space-separated, without the ``#``; the list's
    filter matches ``#tag``). A change of either moves the session's change stamp, so every
    open list sees it."""
    columns = set(db["sessions"].columns_dict)
    if "pinned" not in columns:
        db.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
    if "tags" not in columns:
        db.execute("ALTER TABLE sessions ADD COLUMN tags TEXT NOT NULL DEFAULT ''")
    db.execute(
        f"CREATE TRIGGER IF NOT EXISTS sessions_stamp_pins_tags"
        f" AFTER UPDATE OF pinned, tags ON sessions BEGIN {_STAMP_SESSION} END"
    )


def m024_message_figures(db: sqlite_utils.Database) -> None:
    """Each reply's figures kept with it (issue 41, item 8; see
    :mod:`kvchat.store.figures_sql`): the model that wrote it, its prompt's counts (tokens,
    reused, decoded), tokens generated, time to the first token, tok/s and seconds taken,
    and how its KV got into the context; gone with the message."""
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS message_figures (
            message_id INTEGER PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
            model TEXT NOT NULL DEFAULT '',
            prompt_tokens INTEGER,
            reused INTEGER,
            decoded INTEGER,
            generated INTEGER,
            ttft_ms REAL,
            tokens_per_s REAL,
            seconds REAL,
            kv TEXT NOT NULL DEFAULT '',
            recorded TEXT NOT NULL
        )
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
    m014_session_list_at_scale,
    m015_server_slot_checks,
    m016_message_reasoning,
    m017_server_slot_kv_check,
    m018_documents,
    m019_library_readings,
    m020_drafts,
    m021_tool_messages,
    m022_compaction,
    m023_session_pins_tags,
    m024_message_figures,
]


def applied_names(conn: sqlite3.Connection) -> set[str]:
    """The migrations recorded in ``conn``'s database (none when it has no record yet)."""
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='_migrations'"
    ).fetchone()
    if found is None:
        return set()
    return {row[0] for row in conn.execute("SELECT name FROM _migrations")}


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now.

    Each migration is idempotent (``if_not_exists`` / ``replace``), so one interrupted
    before it was recorded simply runs again.
    """
    done = applied_names(conn)
    due = [m for m in MIGRATIONS if m.__name__ not in done]
    if not due:
        return []
    import sqlite_utils

    db = sqlite_utils.Database(conn)
    if not db["_migrations"].exists():
        db["_migrations"].create({"name": str, "applied": str}, pk="name")
    applied: list[str] = []
    for migration in due:
        name = migration.__name__
        migration(db)
        with conn:
            db["_migrations"].insert({"name": name, "applied": datetime.now(UTC).isoformat()})
        applied.append(name)
    return applied
