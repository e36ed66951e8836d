"""A turn that cannot run stores nothing and says why in one line: invalid UTF-8 on the
command line, an empty message or session name, a message longer than the context; a
failed turn keeps the message of an existing session and says so, and a new session
without a reply is not kept. The real `kvchat` CLI and the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService, UnansweredMessage
from tests.e2e.locks.test_session_lock import assert_user_error
from tests.e2e.text.test_text_stays_text import service

__all__ = ["service"]  # fixtures shared with the module they come from


# --- 4. hostile text and arguments -----------------------------------------------------------


def test_invalid_utf8_in_the_command_line_is_one_line_and_stores_nothing(kvhome: Path, cli):
    result = cli(kvhome, "ask", os.fsdecode(b"\xff\xfe"), check=False)
    assert_user_error(result, "UTF-8")
    assert cli(kvhome, "list", "--json").json == []


@pytest.mark.parametrize("message", ["", "   ", "\n\t"])
def test_an_empty_message_is_refused_before_anything_is_stored(kvhome: Path, cli, message):
    assert_user_error(cli(kvhome, "ask", message, check=False), "empty")
    assert cli(kvhome, "list", "--json").json == []


def test_an_empty_session_name_is_an_error_not_a_new_session(kvhome: Path, cli):
    assert_user_error(cli(kvhome, "ask", "--session", "", "Hi", check=False), "--session")
    assert cli(kvhome, "list", "--json").json == []
    service = ChatService(Settings())
    try:
        service.sessions.new_session(title="Something")
        with pytest.raises(KvchatError, match="no session given"):
            service.sessions.resolve(" ")
    finally:
        service.close()


def test_a_message_longer_than_the_context_stores_nothing(one_turn_home, copy_home, cli):
    home = copy_home(one_turn_home[0], "long")
    session = one_turn_home[1]["session"]
    long = "word " * 400
    assert_user_error(
        cli(home, "ask", long, "--n-ctx", "256", check=False), "does not fit the context"
    )
    assert [s["id"] for s in cli(home, "list", "--json").json] == [session]
    assert_user_error(
        cli(home, "ask", "--session", session, long, "--n-ctx", "256", check=False),
        "does not fit the context",
    )
    assert cli(home, "list", "--json").json[0]["messages"] == 2


def test_a_failed_turn_keeps_the_message_of_an_existing_session_and_says_so(
    service: ChatService, monkeypatch: pytest.MonkeyPatch
):
    engine = service.engine

    def broken(*_args, **_kwargs):
        raise KvchatError("llama.cpp could not decode")

    session = service.sessions.new_session()
    monkeypatch.setattr(engine, "generate", broken)
    with pytest.raises(UnansweredMessage, match="saved in session .* without a reply"):
        service.send(session.id, "Hello?")
    assert [(m.role, m.content) for m in service.sessions.messages(session.id)] == [
        ("user", "Hello?")
    ]
    # A new session started by its first message is rolled back instead.
    with pytest.raises(KvchatError, match="llama.cpp could not decode; nothing was saved"):
        service.start("Hello?")
    assert [s.session.id for s in service.sessions.list_sessions()] == [session.id]


def test_a_new_session_without_a_reply_is_not_kept(
    service: ChatService, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(service.engine, "generate", lambda *_a, **_k: iter(()))
    with pytest.raises(KvchatError, match="no reply; nothing was saved"):
        service.start("Hello?")
    assert service.sessions.list_sessions() == []
