"""Which model each session last ran with (migration m008_session_model).

One row per session: the GGUF file's path as the engine opened it and a short name to
show. Written after each turn; deleted with its session (ON DELETE CASCADE).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.store.connection import SqlBase, now


@dataclass(frozen=True)
class SessionModelRow:
    """The model a session's last turn ran with."""

    session_id: str
    model_path: str
    model_name: str
    updated: str


class SessionModelsSql(SqlBase):
    """The session_models table."""

    def get_session_model(self, session_id: str) -> SessionModelRow | None:
        rows = self._rows(
            "SELECT session_id, model_path, model_name, updated FROM session_models"
            " WHERE session_id=?",
            (session_id,),
        )
        return SessionModelRow(**rows[0]) if rows else None

    def set_session_model(self, session_id: str, model_path: str, model_name: str) -> None:
        """Record (or replace) the model ``session_id`` ran with; a session that is gone
        (deleted by another process) is skipped."""
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO session_models (session_id, model_path, model_name, updated)"
                " SELECT id, ?, ?, ? FROM sessions WHERE id=?"
                " ON CONFLICT(session_id) DO UPDATE SET model_path=excluded.model_path,"
                " model_name=excluded.model_name, updated=excluded.updated",
                (model_path, model_name, now(), session_id),
            )
