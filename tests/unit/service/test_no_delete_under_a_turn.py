"""A session is not deleted under a running turn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService
from kvchat.store.locks import SessionLocks


def test_a_session_is_not_deleted_under_a_running_turn(kvhome: Path):
    service = ChatService(Settings())
    try:
        session = service.sessions.new_session()
        with SessionLocks(kvhome / "locks").hold(session.id):
            with pytest.raises(KvchatError, match=f"process {os.getpid()}"):
                service.sessions.delete(session.id)
        assert [s.session.id for s in service.sessions.list_sessions()] == [session.id]
        service.sessions.delete(session.id)
        assert service.sessions.list_sessions() == []
    finally:
        service.close()
