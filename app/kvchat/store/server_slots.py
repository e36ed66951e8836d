"""Where each session's KV lives on a llama-server: its slot file, exact tokens, server.

One row per session: the file name kvchat gave the slot save (on the server's
``--slot-save-path``), the exact token ids that file holds, and the fingerprint of the
server that wrote it. The file itself is the server's; only this index is kvchat's. Also
what vouches for the file (migration m015_server_slot_checks): its checksum where kvchat
could read it, how many of its tokens hold a full prefill's KV, and why it is never to be
restored again (quarantined) when a restore of it took the server down; and where the
directory is not readable here, the next-token figures the saved KV gave
(m017_server_slot_kv_check: :mod:`kvchat.kvcache.server_tiers` checks a restore with them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvchat.store.connection import SqlBase, now
from kvchat.store.rows import pack_tokens, unpack_tokens


@dataclass
class ServerSlotRow:
    """A session's KV saved by llama-server (``POST /slots/{id}?action=save``)."""

    session_id: str
    filename: str
    token_ids: list[int]
    fingerprint: dict[str, Any]
    n_bytes: int
    generation: int = 0  # counts saves: the file name alternates, so a save never
    created: str = ""  # overwrites the file the row points to
    last_used: str = ""
    # xxh3-64 of the file as saved (hex), when kvchat could read the server's slot directory.
    checksum: str | None = None
    # Leading tokens whose KV is a full prefill's (None: saved before kvchat counted them).
    n_exact: int | None = None
    # Why the file is never restored again (a restore of it broke the server), or None.
    quarantined: str | None = None
    # What the saved KV gave for a few probe tokens (JSON, see kvchat.kvcache.server_tiers),
    # where the slot directory was not readable here; None otherwise.
    kv_check: str | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ServerSlotRow:
        try:
            fingerprint = json.loads(row["fingerprint"] or "{}")
        except ValueError:
            fingerprint = {}
        blob = row["token_ids"] or b""
        return cls(
            session_id=row["session_id"],
            filename=row["filename"],
            token_ids=unpack_tokens(blob) if len(blob) % 4 == 0 else [],
            fingerprint=fingerprint if isinstance(fingerprint, dict) else {},
            n_bytes=int(row["n_bytes"] or 0),
            generation=int(row["generation"] or 0),
            created=row["created"] or "",
            last_used=row["last_used"] or "",
            checksum=row.get("checksum") or None,
            n_exact=None if row.get("n_exact") is None else int(row["n_exact"]),
            quarantined=row.get("quarantined") or None,
            kv_check=row.get("kv_check") if isinstance(row.get("kv_check"), str) else None,
        )


# token_ids read as bytes whatever a damaged row stored there (text would fail to decode).
_SELECT = (
    "SELECT session_id, filename, CAST(token_ids AS BLOB) AS token_ids, fingerprint, n_bytes,"
    " generation, created, last_used, checksum, n_exact, quarantined, kv_check FROM server_slots"
)


class ServerSlotsSql(SqlBase):
    """The server_slots table (migration m007_server_slots)."""

    def get_server_slot(self, session_id: str) -> ServerSlotRow | None:
        rows = self._rows(f"{_SELECT} WHERE session_id=?", (session_id,))
        return ServerSlotRow.from_row(rows[0]) if rows else None

    def put_server_slot(self, row: ServerSlotRow) -> None:
        """Record (or replace) a session's slot file, after the server wrote it."""
        stamp = now()
        with self._tx() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO server_slots (session_id, filename, n_tokens, token_ids,"
                " fingerprint, n_bytes, generation, created, last_used, checksum, n_exact,"
                " quarantined, kv_check) VALUES (?, ?, ?, ?, ?, ?, ?, COALESCE((SELECT created"
                " FROM server_slots WHERE session_id=?), ?), ?, ?, ?, NULL, ?)",
                (
                    row.session_id,
                    row.filename,
                    len(row.token_ids),
                    pack_tokens(row.token_ids),
                    json.dumps(row.fingerprint, sort_keys=True),
                    row.n_bytes,
                    row.generation,
                    row.session_id,
                    stamp,
                    stamp,
                    row.checksum,
                    row.n_exact,
                    row.kv_check,
                ),
            )

    def quarantine_server_slot(self, session_id: str, filename: str, reason: str) -> None:
        """Never restore this row's file again (only if the row still points to it)."""
        with self._tx() as conn:
            conn.execute(
                "UPDATE server_slots SET quarantined=? WHERE session_id=? AND filename=?",
                (reason, session_id, filename),
            )

    def touch_server_slot(self, session_id: str) -> None:
        with self._tx() as conn:
            conn.execute(
                "UPDATE server_slots SET last_used=? WHERE session_id=?", (now(), session_id)
            )

    def delete_server_slots(self, session_id: str | None = None) -> int:
        """Forget one session's slot file (or every one); returns rows deleted."""
        with self._tx() as conn:
            if session_id is None:
                return conn.execute("DELETE FROM server_slots").rowcount
            return conn.execute(
                "DELETE FROM server_slots WHERE session_id=?", (session_id,)
            ).rowcount

    def server_slot_rows(self) -> list[ServerSlotRow]:
        """Every row, least recently used first."""
        rows = self._rows(f"{_SELECT} ORDER BY last_used, session_id")
        return [ServerSlotRow.from_row(r) for r in rows]
