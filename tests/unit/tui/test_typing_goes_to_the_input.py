"""Keys type where the user types (issue 41, item 1): after a search jump, after a click on
a message, and on the sessions list, a sentence typed lands in the input exactly as typed,
opens no screen, makes no branch and sends nothing. The real app with the snapshot tests'
stand-in for the model."""

from __future__ import annotations

import string

from textual.keys import _character_to_key
from textual.pilot import Pilot

from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.search import SearchScreen
from kvchat.tui.widgets.conversation import MessageView
from tests.unit.tui.test_keys_and_copy import service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from

# The sentence, then one whose first key was a key on a message (t, e, i, f, c and
# b acted on it: the first key typed went there while the message still had focus).
SENTENCES = ("Is 101 prime too?", "then is 103? Check it, fetch the bits: i e t c b f!")


def _seed(service: StandInService) -> tuple[str, int]:
    """A session of 8 messages, one of them the search's only hit; its id and the count
    of sessions."""
    session = service.sessions.new_session("Primes")
    for i in range(8):
        role = "user" if i % 2 == 0 else "assistant"
        text = "Is 97 prime? Answer briefly." if i == 2 else f"message {i} about numbers"
        service.store.add_message(session.id, role, text, token_count=5)
    return session.id, len(service.sessions.list_sessions())


async def _type(pilot: Pilot[None], text: str) -> None:
    """Each character as the terminal's key (Textual's name for it)."""
    await pilot.press(*[_character_to_key(c) for c in text])


def _nothing_happened(
    app: KvchatApp, service: StandInService, session_id: str, sessions: int, sentence: str
) -> None:
    main = app.main
    assert app.screen is main, app.screen  # no dialog opened
    assert main.prompt.text == sentence, main.prompt.text  # every character, in order
    assert app.focused is main.prompt
    assert len(service.sessions.list_sessions()) == sessions  # no branch made
    assert len(service.sessions.messages(session_id)) == 8  # nothing sent
    assert main.session_id == session_id and main.turn is None


async def test_a_sentence_typed_after_a_search_jump_lands_in_the_input(
    service: StandInService,
) -> None:
    session_id, sessions = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        for sentence in SENTENCES:
            main.prompt.clear()
            await pilot.press("ctrl+f")
            await _wait(lambda: isinstance(app.screen, SearchScreen))
            await _type(pilot, "97")
            await _wait(lambda: len(getattr(app.screen, "hits", ())) == 1)
            await pilot.press("down", "enter")  # the jump: focus on the hit
            await _wait(lambda: isinstance(app.focused, MessageView) and app.focused.number == 3)
            # Typed at once, while the jump may still mount the messages around the hit.
            await _type(pilot, sentence)
            await _settled(pilot)
            _nothing_happened(app, service, session_id, sessions, sentence)


async def test_a_sentence_typed_after_a_click_on_a_message_lands_in_the_input(
    service: StandInService,
) -> None:
    session_id, sessions = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        for view in (main.conversation.views[-1], main.conversation.views[-2]):  # a reply, yours
            for sentence in SENTENCES:
                main.prompt.clear()
                await pilot.click(view, offset=(2, 1))
                await _wait(lambda view=view: app.focused is view)  # type: ignore[misc]
                await _type(pilot, sentence)
                await _settled(pilot)
                _nothing_happened(app, service, session_id, sessions, sentence)


async def test_every_printable_key_on_a_message_goes_to_the_input(
    service: StandInService,
) -> None:
    """One key at a time, the message focused again before each: none acts on it."""
    session_id, sessions = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        typed = ""
        for character in string.ascii_letters + string.digits + string.punctuation + " ":
            view = main.conversation.views[-1 if len(typed) % 2 else -2]
            view.focus()
            await pilot.pause()
            assert app.focused is view
            await pilot.press(_character_to_key(character))
            await pilot.pause()
            typed += character
            assert app.screen is main, (character, app.screen)
            assert main.prompt.text == typed, character
        assert len(service.sessions.list_sessions()) == sessions
        assert len(service.sessions.messages(session_id)) == 8 and main.turn is None
        await _settled(pilot)
        assert app.screen is main and len(service.sessions.list_sessions()) == sessions


async def test_a_sentence_typed_on_the_sessions_list_lands_in_the_input(
    service: StandInService,
) -> None:
    session_id, sessions = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        for sentence in SENTENCES:
            main.prompt.clear()
            await pilot.press("ctrl+l")
            await _wait(lambda: app.focused is main.sessions)
            await _type(pilot, sentence)
            await _settled(pilot)
            _nothing_happened(app, service, session_id, sessions, sentence)
        # / still filters the titles there, and the filter takes what is typed.
        await pilot.press("ctrl+l")
        await _wait(lambda: app.focused is main.sessions)
        await pilot.press("slash", *"Pri")
        await pilot.pause()
        assert main.sessions.filter_text == "Pri" and main.prompt.text == SENTENCES[-1]
