"""Commands typed in the input: only a registered command's name runs it; any other text
that starts with a slash is sent as typed, ``//`` sends one slash; ``/help`` lists them.
The dispatcher alone, then the real app with the snapshot tests' stand-in for the model."""

from __future__ import annotations

import pytest

from kvchat.tui.main.slash import SlashCommands
from tests.unit.tui.test_keys_and_copy import service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from


def _commands() -> tuple[SlashCommands, list[str]]:
    ran: list[str] = []
    commands = SlashCommands()
    commands.register("compact", "Compact the conversation", "/compact", ran.append)
    return commands, ran


@pytest.mark.parametrize(
    "typed",
    [
        "/etc/hosts is empty, why?",
        "/shrug",
        "/compactly said",
        "/Compact",
        " hello /compact",
        "/compact/x",
        "/",
    ],
)
def test_text_that_names_no_command_is_sent_as_typed(typed: str) -> None:
    commands, ran = _commands()
    dispatched = commands.dispatch(typed)
    assert not dispatched.ran and dispatched.text == typed and ran == []


@pytest.mark.parametrize(
    ("typed", "arguments"),
    [("/compact", ""), ("/compact  keep the last 4 ", "keep the last 4"), ("/compact\nx", "x")],
)
def test_a_command_runs_with_the_text_after_its_name(typed: str, arguments: str) -> None:
    commands, ran = _commands()
    assert commands.dispatch(typed).ran and ran == [arguments]


def test_two_slashes_send_one() -> None:
    commands, ran = _commands()
    dispatched = commands.dispatch("//compact is a word")
    assert not dispatched.ran and dispatched.text == "/compact is a word" and ran == []


def test_names_are_checked_and_taken_once() -> None:
    commands, _ = _commands()
    with pytest.raises(ValueError, match="twice"):
        commands.register("compact", "again", "/compact", print)
    with pytest.raises(ValueError, match="not a command name"):
        commands.register("Two Words", "bad", "/x", print)
    shown: list[str] = []
    commands.on_help(shown.append)
    assert commands.dispatch("/help").ran
    assert shown == [commands.help_text()] and "/compact — Compact" in shown[0]


async def test_the_app_runs_help_and_sends_other_slashes_as_text(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Slashes")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.open_session(session.id, focus_prompt=True)
        await _settled(pilot)
        main.prompt.text = "/help"
        await pilot.press("enter")
        await _settled(pilot)
        assert service.sessions.messages(session.id) == []  # nothing sent
        assert any(n.title == "Commands" for n in app._notifications)
        main.prompt.text = "/shrug, why?"
        await pilot.press("enter")
        await _wait(lambda: len(service.sessions.messages(session.id)) >= 1)
        assert service.sessions.messages(session.id)[0].content == "/shrug, why?"
