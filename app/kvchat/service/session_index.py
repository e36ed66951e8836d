"""The session list and a session's pages alone, over the store: what ``kvchat list``
reads, and what the app paints first while the engine loads.

No engine and no KV tiers, so nothing here imports llama.cpp's bindings, numpy or
sqlite-utils (about a third of a ``kvchat list``'s time went to importing them for a list
of titles; the app's first paint waited ~0.8 s for them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from kvchat.errors import KvchatError
from kvchat.service.checks import open_store
from kvchat.store import Message, MessageWindow, Session, SessionPage, Store

# The meta keys: the session the app had open at quit (set by the app alone: a CLI `ask`
# never moves it), and the last one used anywhere.
OPEN_SESSION_KEY = "app_open_session"
LAST_SESSION_KEY = "last_session"


class SessionReads(Protocol):
    """The reads the app's first paint and its paging need: a :class:`SessionReader`, held
    by the service and by :class:`SessionIndex`."""

    def list_sessions_page(
        self, limit: int, after: tuple[str, int] | None = None, *, title: str | None = None
    ) -> SessionPage: ...

    def change_stamp(self) -> int: ...

    def last_open_session(self) -> Session | None: ...

    def messages_page(
        self, session_id: str, limit: int, *, before: int | None = None
    ) -> list[Message]: ...

    def message_window(
        self,
        session_id: str,
        limit: int,
        *,
        around: int | None = None,
        before_hit: int = 0,
        from_start: bool = False,
    ) -> MessageWindow: ...


class SessionReader:
    """The session list and a session's pages over ``store``: held by :class:`SessionIndex`
    (the reads alone), and by the service beside its other collaborators."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list_sessions_page(
        self,
        limit: int,
        after: tuple[str, int] | None = None,
        *,
        title: str | None = None,
        pinned: bool = False,
        tag: str | None = None,
    ) -> SessionPage:
        """Up to ``limit`` sessions, most recently updated first, after the cursor ``after``
        (the previous page's ``next``); only titles containing ``title`` when given (and
        pinned ones, those tagged ``tag``: see Store.list_sessions_page)."""
        return self.store.list_sessions_page(limit, after, title=title, pinned=pinned, tag=tag)

    def count_sessions(
        self, *, title: str | None = None, pinned: bool = False, tag: str | None = None
    ) -> int:
        """How many sessions there are (whose title contains ``title``, when given…)."""
        return self.store.count_sessions(title=title, pinned=pinned, tag=tag)

    def change_stamp(self) -> int:
        """The session list's change stamp: it moves when any process makes, changes or
        deletes a session (one row read)."""
        return self.store.change_stamp()

    def last_session(self) -> Session | None:
        """The session used last, by any process, else the newest; None in an empty home."""
        session_id = self.store.get_meta(LAST_SESSION_KEY)
        if session_id:
            try:
                return self.store.get_session(session_id)
            except KvchatError:
                pass
        newest = self.store.list_sessions_page(1).sessions  # one row, however many there are
        return newest[0].session if newest else None

    def last_open_session(self) -> Session | None:
        """The session the app had open when it quit, if it still exists; else, for a
        first launch, :meth:`last_session`."""
        session_id = self.store.get_meta(OPEN_SESSION_KEY)
        if session_id:
            try:
                return self.store.get_session(session_id)
            except KvchatError:
                pass
        return self.last_session()

    def messages_page(
        self, session_id: str, limit: int, *, before: int | None = None
    ) -> list[Message]:
        """Up to ``limit`` of the session's messages just before message id ``before`` (the
        last ones when None), in order: a long session opens at its end and pages back."""
        return self.store.messages_page(session_id, limit, before=before)

    def message_window(
        self,
        session_id: str,
        limit: int,
        *,
        around: int | None = None,
        before_hit: int = 0,
        from_start: bool = False,
    ) -> MessageWindow:
        """What an app shows of a session, never reading the whole of it: up to ``limit``
        messages (the last ones; the first ones with ``from_start``; ``before_hit`` before
        the message id ``around``, it and those after), where they sit (the messages before
        and the total), when the session last changed, and the version of its last reply
        when the window ends with it."""
        window = self.store.message_window(
            session_id, limit, around=around, before_hit=before_hit, from_start=from_start
        )
        last = window.messages[-1] if window.messages else None
        if last is not None and last.role == "assistant" and window.later == 0:
            window = replace(window, last_version=self.store.version_of(last.id))
        return window


class SessionIndex:
    """The store at ``database`` (opened with the store's checks) and a :class:`SessionReader`
    over it; closed by :meth:`close` or on leaving a ``with`` block."""

    def __init__(self, database: Path) -> None:
        self.store = open_store(database)
        self.reader = SessionReader(self.store)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> SessionIndex:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
