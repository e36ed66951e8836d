"""Drafts (issue 41, item 2): what is typed in the input is kept per session, written to the
store once typing pauses, shown again when the session is opened again or the app is
launched again, and gone once sent; a reply cut off by a kill says so. The real app and
store with the snapshot tests' stand-in for the model."""

from __future__ import annotations

import time
from pathlib import Path

from kvchat.config import Settings
from kvchat.service.streaming import STREAMING
from kvchat.tui.main.drafts import DRAFT_SAVE_AFTER_S
from kvchat.tui.widgets import message_view
from tests.unit.tui.test_keys_and_copy import service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from


def _draft(service: StandInService, session_id: str) -> str:
    return service.sessions.draft(session_id)


async def test_a_draft_is_kept_per_session_and_written_after_a_pause(
    service: StandInService,
) -> None:
    first = service.sessions.new_session("First")
    service.store.add_message(first.id, "user", "one", token_count=1)
    second = service.sessions.new_session("Second")
    service.store.add_message(second.id, "user", "two", token_count=1)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.session_id == second.id
        await pilot.press(*"half a thought")
        typed = time.monotonic()
        await _wait(lambda: _draft(service, second.id) == "half a thought", 5)
        waited = time.monotonic() - typed
        print(
            f"\ndraft in the store {waited * 1000:,.0f} ms after the last key "
            f"(written {DRAFT_SAVE_AFTER_S * 1000:,.0f} ms after the last change)"
        )
        # Switching: the input's text stays with its session, the other's shows.
        main.open_session(first.id)
        await _wait(lambda: main.session_id == first.id)
        await _settled(pilot)
        assert main.prompt.text == ""
        await pilot.press(*"other words")
        main.open_session(second.id)
        await _wait(lambda: main.session_id == second.id and main.prompt.text == "half a thought")
        await _settled(pilot)
        assert _draft(service, first.id) == "other words"  # written at the switch
        # Sent: the draft goes with it.
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _wait(lambda: _draft(service, second.id) == "", 5)
        assert service.sessions.messages(second.id)[-2].content == "half a thought"


async def test_a_relaunch_shows_the_draft_and_a_quit_writes_it_at_once(kvhome: Path) -> None:
    service = StandInService(Settings(n_ctx=8192, n_threads=1))
    session = service.sessions.new_session("Kept")
    service.store.add_message(session.id, "user", "hello", token_count=1)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press(*"typed then quit")
        app.simulate_key("ctrl+q")  # at once: before the pause that would write it
        await _wait(lambda: app._closed)
    again = StandInService(Settings(n_ctx=8192, n_threads=1))
    assert again.sessions.draft(session.id) == "typed then quit"
    app, run = start(again)
    async with run as pilot:
        await _settled(pilot)
        await _wait(lambda: app.main.prompt.text == "typed then quit")
        assert app.main.session_id == session.id
        # The cursor at its end: typing goes on where it stopped.
        await pilot.press(*" and more")
        assert app.main.prompt.text == "typed then quit and more"


async def test_a_reply_cut_off_by_a_kill_says_so(service: StandInService) -> None:
    assert message_view.STREAMING == STREAMING  # the app's copy of the service's marker
    session = service.sessions.new_session("Cut")
    service.store.add_message(session.id, "user", "Tell me a story", token_count=4)
    service.store.add_message(
        session.id, "assistant", "Once upon", token_count=2, partial=True, finish_reason=STREAMING
    )
    stopped = service.sessions.new_session("Stopped")
    service.store.add_message(stopped.id, "user", "Another", token_count=1)
    service.store.add_message(
        stopped.id, "assistant", "Half", token_count=1, partial=True, finish_reason="cancelled"
    )
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.session_id == stopped.id
        assert (
            main.conversation.views[-1].drawn_lines[0].strip()
            == "Assistant · #2 · partial (stopped)"
        )
        main.open_session(session.id)
        await _wait(lambda: main.shown_id == session.id)
        await _settled(pilot)
        header = main.conversation.views[-1].drawn_lines[0].strip()
        assert header == "Assistant · #2 · cut off: kvchat ended"
