"""One turn at a time per session: a turn holds its session for its whole length, a second
process waits and then names the one that has the session, and services can share one
loaded engine. The real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService
from kvchat.store.locks import SessionLocks
from tests.conftest import FAST
from tests.e2e.text.test_text_stays_text import GREEDY, service

__all__ = ["service"]  # fixtures shared with the module they come from


def assert_user_error(result, text: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvchat: ") and text in lines[0], lines[0]


# --- 3. one turn per session -----------------------------------------------------------------


def test_a_turn_holds_its_session_for_its_whole_length(service: ChatService, kvhome: Path):
    session = service.sessions.new_session()
    seen: list[str] = []

    def try_to_cut_in(_piece: str) -> None:
        if not seen:
            with pytest.raises(KvchatError, match="busy"):
                with SessionLocks(kvhome / "locks").hold(session.id, wait_s=0):
                    pass
        seen.append(_piece)

    service.send(session.id, "Name a colour.", on_token=try_to_cut_in)
    assert seen
    with SessionLocks(kvhome / "locks").hold(session.id, wait_s=0):
        pass  # released after the turn


def test_a_second_process_waits_then_names_the_one_that_has_the_session(
    one_turn_home, copy_home, cli
):
    home = copy_home(one_turn_home[0], "busy")
    session = one_turn_home[1]["session"]
    before = cli(home, "list", "--json").json[0]["messages"]
    with SessionLocks(home / "locks").hold(session):
        result = cli(home, "ask", "--session", session, "Hello?", *FAST, check=False)
    assert_user_error(result, "busy")
    assert f"process {os.getpid()}" in result.stderr
    assert cli(home, "list", "--json").json[0]["messages"] == before  # nothing stored


# --- 6. a loaded engine shared by services ------------------------------------------------------


def test_services_can_share_one_loaded_engine(tmp_path: Path):
    owner = ChatService(Settings(**GREEDY), home=tmp_path / "owner")
    engine = owner.engine
    replies = []
    for name in ("a", "b"):
        service = ChatService(Settings(**GREEDY), home=tmp_path / name, engine=engine)
        session = service.sessions.new_session()
        replies.append(service.send(session.id, "Name a colour.").reply)
        service.close()
    fresh = ChatService(Settings(**GREEDY), home=tmp_path / "fresh")
    session = fresh.sessions.new_session()
    assert replies == [fresh.send(session.id, "Name a colour.").reply] * 2
    fresh.close()
    assert engine.tokenize("still open")  # the services did not close it
    other = ChatService(Settings(**{**GREEDY, "n_ctx": 512}), home=tmp_path / "c", engine=engine)
    with pytest.raises(ValueError, match="n_ctx"):
        other.load_engine()
    other.close()
    owner.close()
