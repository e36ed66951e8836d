"""The app opened again opens the session it had open (the CLI and the app agree on it);
real `kvchat` processes."""

from __future__ import annotations

from pathlib import Path

# --- item 2: relaunch opens the session the app had open ---------------------------------------


def test_relaunch_opens_the_session_the_app_had_open(kvhome: Path) -> None:
    from kvchat.config import load_settings
    from kvchat.service.chat import ChatService

    service = ChatService(load_settings())
    try:
        assert service.reader.last_open_session() is None
        a = service.sessions.new_session("A")
        b = service.sessions.new_session("B")
        assert service.reader.last_open_session().id == b.id  # never opened: the last one made
        service.sessions.remember_open(a.id)
        service.sessions.new_session("made by a CLI ask")
        service.sessions.fork(b.id)
        assert service.reader.last_open_session().id == a.id
    finally:
        service.close()
    # A new process (a relaunch) reads the same.
    service = ChatService(load_settings())
    try:
        assert service.reader.last_open_session().id == a.id
        service.sessions.delete(a.id)
        assert service.reader.last_open_session() is not None  # gone: the fallback, no error
    finally:
        service.close()
