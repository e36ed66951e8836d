"""Forks and edits record the message they were made from, and deleting a session
reparents its forks; the real model writes the turns."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_forks_and_edits_record_their_parent_and_delete_reparents(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    """Issue 11.11: the branch view's tree comes from ``parent_id``."""
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService

    class Counting:  # edit counts the edited message's tokens; no model needed here
        @staticmethod
        def count_tokens(text: str) -> int:
            return len(text.split())

    monkeypatch.setattr(ChatService, "engine", property(lambda self: Counting()))
    service = ChatService(Settings())
    try:
        root = service.sessions.new_session("Root")
        question = service.sessions.add_message(root.id, "user", "first question")
        service.sessions.add_message(root.id, "assistant", "first answer")
        assert root.parent_id is None
        fork = service.sessions.fork(root.id)
        edit = service.sessions.edit(root.id, question.id, "edited question")
        grandchild = service.sessions.fork(fork.id)
        assert fork.parent_id == root.id and edit.parent_id == root.id
        assert grandchild.parent_id == fork.id
        parents = {s.session.id: s.session.parent_id for s in service.sessions.list_sessions()}
        assert parents == {
            root.id: None,
            fork.id: root.id,
            edit.id: root.id,
            grandchild.id: fork.id,
        }

        service.sessions.delete(fork.id)  # its branch moves up to the grandparent
        assert service.sessions.resolve(grandchild.id).parent_id == root.id
        service.sessions.delete(root.id)  # and to no parent at the top
        parents = {s.session.id: s.session.parent_id for s in service.sessions.list_sessions()}
        assert parents == {edit.id: None, grandchild.id: None}
    finally:
        service.close()
