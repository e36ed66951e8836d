"""The session list alone, over the store: what ``kvchat list`` reads.

No engine and no KV tiers, so nothing here imports llama.cpp's bindings (about a third of
a ``kvchat list``'s time went to importing them for a list of titles).
"""

from __future__ import annotations

from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.service.checks import os_error_line
from kvchat.store import SessionPage, Store


class SessionIndex:
    """Pages of the session list and its count, read from the database at ``database``
    (opened with the store's checks, closed on leaving a ``with`` block)."""

    def __init__(self, database: Path) -> None:
        try:
            self.store = Store(database)
        except OSError as exc:
            raise KvchatError(os_error_line("cannot open the database", exc)) from None

    def __enter__(self) -> SessionIndex:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.store.close()

    def list_sessions_page(
        self, limit: int, after: tuple[str, int] | None = None, *, title: str | None = None
    ) -> SessionPage:
        """Up to ``limit`` sessions, most recently updated first, after the cursor ``after``
        (the previous page's ``next``); only titles containing ``title`` when given."""
        return self.store.list_sessions_page(limit, after, title=title)

    def count_sessions(self, *, title: str | None = None) -> int:
        """How many sessions there are (whose title contains ``title``, when given)."""
        return self.store.count_sessions(title=title)
