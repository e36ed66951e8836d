"""Whole sessions inserted at once (``kvchat import``), recorded by meta keys."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from kvchat.errors import KvchatError
from kvchat.store.connection import SqlBase, now
from kvchat.store.documents_sql import insert_imported_documents
from kvchat.store.sessions_sql import new_session_id
from kvchat.store.summaries_sql import insert_imported_summaries
from kvchat.store.tools_sql import insert_imported_tools


class ImportsSql(SqlBase):
    """Imports: all of a file's sessions in one transaction, each recorded once."""

    def claimed_sessions(self, key: str) -> list[str]:
        """The sessions that meta ``key`` (an import's record) names and that still exist."""
        value = self.get_meta(key)
        try:
            ids = json.loads(value) if value else []
        except ValueError:
            return []
        ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
        return [
            i
            for i in ids
            if isinstance(i, str) and self._rows("SELECT 1 FROM sessions WHERE id=?", (i,))
        ]

    def import_sessions(
        self, sessions: Iterable[dict[str, Any]], file_key: str
    ) -> list[tuple[str, bool]]:
        """Insert whole sessions with their messages in one transaction (all or nothing),
        taking them from ``sessions`` as they come (an exception it raises stores none).

        Each item: ``title``, ``system_prompt``, ``settings``, ``created``/``updated`` (None:
        now), ``messages`` as (role, content, created or None, token_count, partial), optional
        ``documents`` (:data:`~kvchat.store.documents_sql.ImportedDocumentFields`, placed by
        message index), optional ``summaries`` as (message index, text, replaced tokens),
        and ``key``: a meta key for its content, or None. An item whose key names a session that
        still exists is not inserted again. ``file_key`` records every session of the file.
        Returns (session id, inserted now) per item. Raises KvchatError if ``file_key``
        already names live sessions (another import of the same file won the race).
        """
        stamp = now()
        results: list[tuple[str, bool]] = []
        with self._tx() as conn:
            # The first write takes the database's write lock: the checks below can't race.
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, '[]') ON CONFLICT(key) DO NOTHING",
                (file_key,),
            )

            def live(key: str) -> list[str]:
                row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
                try:
                    ids = json.loads(row[0]) if row and row[0] else []
                except ValueError:
                    return []
                ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
                found = [
                    i
                    for i in ids
                    if isinstance(i, str)
                    and conn.execute("SELECT 1 FROM sessions WHERE id=?", (i,)).fetchone()
                ]
                return found

            taken = live(file_key)
            if taken:
                raise KvchatError(f"this file was already imported as {', '.join(taken)}")
            index_after = _index_at_the_end(conn)
            for item in sessions:
                key = item.get("key")
                earlier = live(key) if key else []
                if earlier:
                    results.append((earlier[0], False))
                    continue
                session_id = new_session_id(conn)
                created = item.get("created") or stamp
                conn.execute(
                    "INSERT INTO sessions (id, title, system_prompt, settings, created, updated)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        session_id,
                        item["title"],
                        item.get("system_prompt"),
                        json.dumps(item.get("settings") or {}),
                        created,
                        item.get("updated") or created,
                    ),
                )
                conn.executemany(
                    "INSERT INTO messages"
                    " (session_id, role, content, created, token_count, partial, reasoning)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        # (role, content, when, tokens, partial[, reasoning])
                        (session_id, m[0], m[1], m[2] or created, m[3], int(m[4]), _reasoning(m))
                        for m in item["messages"]
                    ],
                )
                documents = item.get("documents")
                tools = item.get("tools")
                summaries = item.get("summaries")
                if documents or tools or summaries:
                    ids = [
                        row[0]
                        for row in conn.execute(
                            "SELECT id FROM messages WHERE session_id=? ORDER BY id", (session_id,)
                        )
                    ]
                    if documents:
                        insert_imported_documents(conn, session_id, documents, ids, stamp)
                    if tools:
                        insert_imported_tools(conn, tools, ids)
                    if summaries:
                        insert_imported_summaries(conn, session_id, summaries, ids, stamp)
                if key:
                    conn.execute(
                        "INSERT INTO meta (key, value) VALUES (?, ?)"
                        " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (key, json.dumps(session_id)),
                    )
                results.append((session_id, True))
            conn.execute(
                "UPDATE meta SET value=? WHERE key=?",
                (json.dumps([session_id for session_id, _ in results]), file_key),
            )
            if index_after is not None:
                first_new, trigger = index_after
                conn.execute(
                    "INSERT INTO messages_fts (rowid, content)"
                    " SELECT id, content FROM messages WHERE id > ?",
                    (first_new,),
                )
                conn.execute(trigger)
        return results


# The search index's insert trigger (sqlite-utils' enable_fts in migration 2), and what it does.
FTS_INSERT_TRIGGER = "messages_ai"
_FTS_INSERT = 'INSERT INTO "messages_fts" (rowid, "content") VALUES (new.rowid, new."content")'


def _index_at_the_end(conn: sqlite3.Connection) -> tuple[int, str] | None:
    """Let an import index its messages for search in one statement at its end (FTS5 takes
    a batch about twice as fast as a row at a time): drop the insert trigger, inside the
    import's transaction, and return the last message id before the import and the
    trigger's SQL, to index what came after it and put the trigger back as it was (a
    failed import rolls the drop back with the rest). None, changing nothing, when the
    trigger is not the one kvchat made."""
    assert conn.in_transaction  # the drop must roll back with the import
    row = conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = ?",
        (FTS_INSERT_TRIGGER,),
    ).fetchone()
    if row is None or _FTS_INSERT not in row[0]:
        return None
    first_new = conn.execute("SELECT COALESCE(MAX(id), 0) FROM messages").fetchone()[0]
    conn.execute(f'DROP TRIGGER "{FTS_INSERT_TRIGGER}"')
    return int(first_new), str(row[0])


def _reasoning(message: Any) -> str:
    """An imported message's reasoning: its sixth field, when the format has one."""
    return str(message[5] or "") if len(message) > 5 else ""
