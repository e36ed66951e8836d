"""Documents a conversation was given (attachments) and the document library.

A document's row holds what was read from the file: its name, kind, size, sha256 of the
raw bytes and the extracted text (the text is the truth: the model reads it, exports and
bundles carry it; the file itself may change or go). One row per distinct content
(sha256 and name), shared by every conversation that attached it. ``session_documents``
says which session uses which documents and where: ``message_id`` NULL for documents
given when the conversation started (rendered after the system prompt, so conversations
with the same documents share a token prefix), else the user message they came with.
``in_library`` marks documents the user keeps (``kvchat docs add``): read ahead of time,
their KV exempt from the disk budget's eviction until removed.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvchat.store.connection import SqlBase, now


@dataclass(frozen=True)
class DocumentRow:
    """One document as read (its text) and where it came from (for display only)."""

    id: str
    name: str
    kind: str
    size: int
    sha256: str
    text: str
    pages: int | None = None
    source: str = ""  # the path as the user gave it: shown, and re-read to spot a change
    added: str = ""
    in_library: bool = False

    @staticmethod
    def key(name: str, sha256: str) -> str:
        """The row id of a document: its content and the name it is shown under (the name
        is part of the text the model reads, so two names are two documents)."""
        return hashlib.sha256(f"{sha256}\0{name}".encode()).hexdigest()[:32]

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> DocumentRow:
        return cls(
            id=str(row["id"]),
            name=str(row["name"]),
            kind=str(row["kind"]),
            size=int(row["size"]),
            sha256=str(row["sha256"]),
            text=str(row["text"]),
            pages=None if row["pages"] is None else int(row["pages"]),
            source=str(row["source"] or ""),
            added=str(row["added"] or ""),
            in_library=bool(row["in_library"]),
        )


@dataclass(frozen=True)
class SessionDocument:
    """A document a session uses: at its start (``message_id`` None) or with a message."""

    document: DocumentRow
    message_id: int | None
    position: int


@dataclass(frozen=True)
class LibraryReading:
    """A library document's reading: the hidden session whose snapshot holds its KV, the
    model and KV type that read it, and its tokens (the shared prefix)."""

    document_id: str
    reading_id: str
    model: str
    kv_type: str
    tokens: int
    read_at: str

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> LibraryReading:
        return cls(
            document_id=str(row["document_id"]),
            reading_id=str(row["reading_id"]),
            model=str(row["model"]),
            kv_type=str(row["kv_type"]),
            tokens=int(row["tokens"]),
            read_at=str(row["read_at"]),
        )


_COLUMNS = (
    "d.id, d.name, d.kind, d.size, d.sha256, d.text, d.pages, d.source, d.added, d.in_library"
)


def copy_session_documents(
    conn: sqlite3.Connection, source_id: str, target_id: str, message_ids: dict[int, int]
) -> None:
    """Give a copy of a session (a fork, an edit's branch) the documents of its source, in
    the copy's transaction: those of the start, and those of each copied message
    (``message_ids`` maps the source's message ids to the copy's)."""
    rows = conn.execute(
        "SELECT document_id, message_id, position FROM session_documents WHERE session_id=?",
        (source_id,),
    ).fetchall()
    for doc_id, message_id, position in rows:
        if message_id >= 0 and message_id not in message_ids:
            continue
        target_message = message_id if message_id < 0 else message_ids[message_id]
        conn.execute(
            "INSERT OR IGNORE INTO session_documents (session_id, document_id, message_id,"
            " position) VALUES (?, ?, ?, ?)",
            (target_id, doc_id, target_message, position),
        )


def _insert_document(conn: sqlite3.Connection, doc: DocumentRow, stamp: str) -> None:
    conn.execute(
        "INSERT INTO documents (id, name, kind, size, sha256, text, pages, source,"
        " added, in_library) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        # A library document keeps the path it was added from (``docs list`` looks there);
        # an attachment's row shows the path it was last attached from.
        " ON CONFLICT(id) DO UPDATE SET source=CASE WHEN documents.in_library=1"
        " AND excluded.in_library=0 THEN documents.source ELSE excluded.source END,"
        " in_library=MAX(in_library, excluded.in_library)",
        (
            doc.id,
            doc.name,
            doc.kind,
            doc.size,
            doc.sha256,
            doc.text,
            doc.pages,
            doc.source,
            doc.added or stamp,
            int(doc.in_library),
        ),
    )


def _insert_reading(conn: sqlite3.Connection, reading: LibraryReading) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO library_readings (document_id, reading_id, model, kv_type,"
        " tokens, read_at) VALUES (?, ?, ?, ?, ?, ?)",
        (
            reading.document_id,
            reading.reading_id,
            reading.model,
            reading.kv_type,
            reading.tokens,
            reading.read_at or now(),
        ),
    )


class DocumentsSql(SqlBase):
    """The documents and session_documents tables (migration m018_documents)."""

    def put_documents(self, documents: Iterable[DocumentRow]) -> None:
        """Store documents (a row already there keeps its text: same key, same content)."""
        stamp = now()
        with self._tx() as conn:
            for doc in documents:
                _insert_document(conn, doc, stamp)

    def attach_documents(
        self, session_id: str, document_ids: list[str], message_id: int | None = None
    ) -> None:
        """Say that a session uses these documents, in this order: at its start
        (``message_id`` None) or with that message. Attaching again changes nothing."""
        with self._tx() as conn:
            for position, doc_id in enumerate(document_ids):
                conn.execute(
                    "INSERT OR IGNORE INTO session_documents (session_id, document_id,"
                    " message_id, position) VALUES (?, ?, ?, ?)",
                    (session_id, doc_id, -1 if message_id is None else message_id, position),
                )

    def session_documents(self, session_id: str) -> list[SessionDocument]:
        """Every document the session uses: those of its start first, then by message."""
        rows = self._rows(
            f"SELECT {_COLUMNS}, s.message_id, s.position FROM session_documents s"
            " JOIN documents d ON d.id = s.document_id WHERE s.session_id=?"
            " ORDER BY s.message_id, s.position",
            (session_id,),
        )
        return [
            SessionDocument(
                DocumentRow.from_row(r),
                None if r["message_id"] < 0 else int(r["message_id"]),
                int(r["position"]),
            )
            for r in rows
        ]

    def documents(self, *, library: bool | None = None) -> list[DocumentRow]:
        """Every stored document (only the library's, or only the rest), by name."""
        where = "" if library is None else f" WHERE d.in_library={int(library)}"
        rows = self._rows(f"SELECT {_COLUMNS} FROM documents d{where} ORDER BY d.name, d.id")
        return [DocumentRow.from_row(r) for r in rows]

    def document_use(self) -> dict[str, int]:
        """How many sessions use each document."""
        rows = self._rows(
            "SELECT document_id, COUNT(DISTINCT session_id) AS n FROM session_documents"
            " GROUP BY document_id"
        )
        return {str(r["document_id"]): int(r["n"]) for r in rows}

    def set_in_library(self, document_id: str, keep: bool) -> bool:
        """Keep a document in the library, or take it out; False when there is no such row."""
        with self._tx() as conn:
            changed = conn.execute(
                "UPDATE documents SET in_library=? WHERE id=?", (int(keep), document_id)
            ).rowcount
        return changed > 0

    def library_document(self, ref: str) -> DocumentRow | None:
        """The library's document named ``ref`` (its name, or its id or a unique prefix of
        it at least 6 characters long), or None; a name shared by two library documents
        (two versions of one file) gives the newest."""
        rows = self._rows(
            f"SELECT {_COLUMNS} FROM documents d WHERE d.in_library=1 AND d.name=?"
            " ORDER BY d.added DESC, d.id LIMIT 1",
            (ref,),
        )
        if not rows and len(ref) >= 6 and all(c in "0123456789abcdef" for c in ref):
            rows = self._rows(
                f"SELECT {_COLUMNS} FROM documents d WHERE d.in_library=1 AND d.id LIKE ? LIMIT 2",
                (f"{ref}%",),
            )
            rows = rows if len(rows) == 1 else []
        return DocumentRow.from_row(rows[0]) if rows else None

    def add_to_library(self, document: DocumentRow, reading: LibraryReading | None) -> None:
        """Store a document in the library with its reading (pinned), in one transaction:
        a document is in the library with its KV, or not at all."""
        with self._tx() as conn:
            _insert_document(conn, document, now())
            conn.execute("UPDATE documents SET in_library=1 WHERE id=?", (document.id,))
            if reading is not None:
                _insert_reading(conn, reading)

    def library_readings(self, document_id: str | None = None) -> list[LibraryReading]:
        """The readings the library keeps (of one document), oldest first."""
        where = "" if document_id is None else " WHERE document_id=?"
        rows = self._rows(
            f"SELECT * FROM library_readings{where} ORDER BY read_at, reading_id",
            () if document_id is None else (document_id,),
        )
        return [LibraryReading.from_row(r) for r in rows]

    def pinned_sessions(self) -> set[str]:
        """The session ids whose snapshots the disk budget must not evict: the readings of
        documents kept in the library."""
        rows = self._rows(
            "SELECT r.reading_id FROM library_readings r JOIN documents d"
            " ON d.id = r.document_id WHERE d.in_library=1"
        )
        return {str(r["reading_id"]) for r in rows}

    def remove_from_library(self, document_id: str) -> list[str]:
        """Take a document out of the library and un-pin its readings (their snapshots stay,
        now evictable like any other); returns the readings un-pinned."""
        with self._tx() as conn:
            readings = [
                str(r[0])
                for r in conn.execute(
                    "SELECT reading_id FROM library_readings WHERE document_id=?", (document_id,)
                ).fetchall()
            ]
            conn.execute("DELETE FROM library_readings WHERE document_id=?", (document_id,))
            conn.execute("UPDATE documents SET in_library=0 WHERE id=?", (document_id,))
        return readings

    def forget_unused_documents(self) -> int:
        """Delete documents no session uses and the library does not keep; returns rows."""
        with self._tx() as conn:
            return conn.execute(
                "DELETE FROM documents WHERE in_library=0 AND id NOT IN"
                " (SELECT document_id FROM session_documents)"
            ).rowcount

    def ensure_reading(self, reading_id: str, title: str) -> None:
        """A session row to own a reading's snapshot (its 24-digit id keeps it out of every
        list: see ``sessions_sql.LISTED``); nothing when it exists."""
        stamp = now()
        with self._tx() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO sessions (id, title, system_prompt, settings, created,"
                " updated) VALUES (?, ?, NULL, '{}', ?, ?)",
                (reading_id, title, stamp, stamp),
            )


# An imported document: (name, kind, size, sha256, text, pages, index of the imported
# message it came with or None for the start), checked by the importer (kvchat.transfer).
ImportedDocumentFields = tuple[str, str, int, str, str, int | None, int | None]


def imported_key(name: str, sha256: str, text: str) -> str:
    """The row id of a document that came in a file (an export, a bundle): its text is part
    of the key, since no bytes came to re-derive the sha256 from, so an imported text never
    takes the place of the one a file read here would give."""
    digest = hashlib.sha256(f"import\0{sha256}\0{name}\0".encode())
    digest.update(text.encode("utf-8"))
    return digest.hexdigest()[:32]


def insert_imported_documents(
    conn: sqlite3.Connection,
    session_id: str,
    documents: Iterable[ImportedDocumentFields],
    message_ids: list[int],
    stamp: str,
) -> None:
    """Give an imported session its documents, in the import's transaction, placed as in
    the file (``message_ids``: the imported messages' ids, in order). A document already
    here with the same name, sha256 and text is shared; any other is a row of its own."""
    positions: dict[int, int] = {}
    for name, kind, size, sha256, text, pages, at in documents:
        doc_id = DocumentRow.key(name, sha256)
        here = conn.execute("SELECT text FROM documents WHERE id=?", (doc_id,)).fetchone()
        if here is None or here[0] != text:
            doc_id = imported_key(name, sha256, text)
        conn.execute(
            "INSERT INTO documents (id, name, kind, size, sha256, text, pages, source, added,"
            " in_library) VALUES (?, ?, ?, ?, ?, ?, ?, '', ?, 0) ON CONFLICT(id) DO NOTHING",
            (doc_id, name, kind, size, sha256, text, pages, stamp),
        )
        message_id = -1 if at is None else message_ids[at]
        position = positions.get(message_id, 0)
        positions[message_id] = position + 1
        conn.execute(
            "INSERT OR IGNORE INTO session_documents (session_id, document_id, message_id,"
            " position) VALUES (?, ?, ?, ?)",
            (session_id, doc_id, message_id, position),
        )
