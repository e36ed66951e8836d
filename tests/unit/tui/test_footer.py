"""The footer is rebuilt only when the keys it shows change: a focus move (a session
switch moves it twice) leaves it as it is, a narrow window still drops the palette's key.
Model-free: the stand-in service of the snapshot tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets._footer import FooterKey

from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.footer import KeysFooter
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait


@pytest.fixture
def service(kvhome: Path) -> StandInService:
    return StandInService(Settings(n_ctx=8192, n_threads=1))


async def test_a_focus_move_keeps_the_footer_and_a_narrow_window_rebuilds_it(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Talk")
    service.store.add_message(session.id, "user", "Hello there", token_count=3)
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await _settled(pilot)
        main = app.main
        footer = main.query_one(KeysFooter)
        keys = list(footer.query(FooterKey))
        assert any(k.key == "ctrl+p" for k in keys)  # the palette's key, at this width
        for widget in (main.sessions, main.prompt, main.conversation.views[0], main.prompt):
            widget.focus()
            await pilot.pause()
            assert app.focused is widget
        await pilot.pause()
        assert list(footer.query(FooterKey)) == keys  # the same widgets: not rebuilt

        await pilot.resize_terminal(70, 30)  # narrow: no room for the palette's key
        await _wait(lambda: not any(k.key == "ctrl+p" for k in footer.query(FooterKey)))
        assert all(k not in keys for k in footer.query(FooterKey))  # built again
