"""F5 offers every code block of the session (issue 41, item 5): read from the store, not
from the messages drawn, so blocks of messages far above the screen are offered without
paging to them first. The real app and store with the snapshot tests' stand-in model."""

from __future__ import annotations

from textual.widgets import OptionList

from kvchat.tui.screens.dialogs import CodePickerDialog
from tests.unit.tui.test_keys_and_copy import service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from

WITH_CODE = {4, 6, *range(15, 23)}  # the messages (#) holding a code block


def _text(number: int) -> str:
    if number in WITH_CODE:
        return f"Block of #{number}:\n\n```python\nprint({number})\n```\n"
    return f"message {number}, no code"


async def test_f5_offers_every_code_block_of_a_32_message_session(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Code everywhere")
    for number in range(1, 33):
        role = "user" if number % 2 else "assistant"
        service.store.add_message(session.id, role, _text(number), token_count=5)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        shown = {v.number for v in main.conversation.views}
        assert 4 not in shown  # the session opens at its end: #4 is not drawn
        assert app.focused is main.prompt
        await pilot.press("f5")
        await _wait(lambda: isinstance(app.screen, CodePickerDialog))
        picker = app.screen
        assert isinstance(picker, CodePickerDialog)
        assert picker.blocks == [f"print({n})" for n in sorted(WITH_CODE)]
        assert picker.where == [f"#{n}" for n in sorted(WITH_CODE)]
        # The oldest, picked from the keyboard: copied.
        options = picker.query_one("#blocks", OptionList)
        options.highlighted = 0
        await pilot.press("enter")
        await _wait(lambda: app.clipboard == "print(4)")
