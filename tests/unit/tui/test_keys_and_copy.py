"""Keys work under tmux: no key is tmux's prefix and every key works while typing, F5 copies
a code block while typing, Tab stops once on the messages, and help lists the keys. The
real app with the snapshot tests' stand-in for the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input

from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.keys import KEYS, bindings
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.widgets.conversation import MessageView
from kvchat.tui.widgets.prompt import PromptInput
from tests.unit.tui.test_tui_snapshots import REPLY, StandInService, _settled, _wait

SIZE = (100, 30)


@pytest.fixture
def service(kvhome: Path, monkeypatch: pytest.MonkeyPatch) -> StandInService:
    # Copies go by OSC 52 unless a test puts the app under (a fake) tmux.
    for name in ("TMUX", "DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    return StandInService(Settings(n_ctx=8192, n_threads=1))


def start(service: StandInService, size: tuple[int, int] = SIZE) -> tuple[KvchatApp, Any]:
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    return app, app.run_test(size=size)


def notices(app: KvchatApp) -> list[str]:
    return [n.message for n in app._notifications]


def add_pairs(service: StandInService, session_id: str, n: int, text: str = "line") -> None:
    for i in range(n):
        service.store.add_message(session_id, "user", f"{text} {2 * i}", token_count=3)
        service.store.add_message(session_id, "assistant", f"{text} {2 * i + 1}", token_count=4)


# --- item 9: keys under tmux ---------------------------------------------------------------


def _widget_keys(cls: type) -> set[str]:
    keys: set[str] = set()
    for klass in cls.__mro__:
        for binding in getattr(klass, "BINDINGS", []):
            key = binding.key if hasattr(binding, "key") else binding[0]
            keys |= {k.strip() for k in key.split(",")}
    return keys


def test_no_key_is_tmux_prefix_and_every_key_works_while_typing() -> None:
    app_keys = {k.strip() for b in bindings() for k in b.key.split(",")}
    assert "ctrl+b" not in app_keys  # tmux's prefix never reaches the app
    copy_code = next(k for k in KEYS if k.action == "copy_code")
    assert copy_code.keys == "f5"
    # The input (a TextArea) and the dialogs' Input take keys first: none may shadow an app key.
    for cls in (PromptInput, Input):
        assert not (app_keys - {"escape", "ctrl+q"}) & _widget_keys(cls), cls


async def test_f5_copies_a_code_block_while_typing(service: StandInService) -> None:
    session = service.sessions.new_session("Code")
    service.store.add_message(session.id, "user", "sort?", token_count=2)
    service.store.add_message(session.id, "assistant", REPLY, token_count=9)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        assert app.focused is app.main.prompt
        await pilot.press("f5")
        await _wait(lambda: app.clipboard.startswith("people = "))
        await _wait(lambda: any("Copied the code block" in n for n in notices(app)))


async def test_tab_stops_once_on_the_messages_and_arrows_move_between_them(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Six")
    add_pairs(service, session.id, 3)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        views = main.conversation.views
        assert len(views) == 6 and app.focused is main.prompt
        cycle = []
        for _ in range(12):
            await pilot.press("tab")
            cycle.append(app.focused)
            if app.focused is main.prompt:
                break
        assert cycle[-1] is main.prompt
        assert [w for w in cycle if isinstance(w, MessageView)] == [views[-1]]  # one stop
        assert len(cycle) == 3  # sessions, the messages, the input
        # Back to the messages, then ↑/↓ move between them.
        await pilot.press("shift+tab")
        assert app.focused is views[-1]
        await pilot.press("up", "up")
        assert app.focused is views[-3]
        await pilot.press("down")
        assert app.focused is views[-2]
        # The message last visited stays the tab stop.
        await pilot.press("tab", "shift+tab")
        assert app.focused is views[-2]
        await pilot.press("down", "down")  # past the last message: the input
        assert app.focused is main.prompt
        # A click focuses any message.
        await pilot.click(views[0])
        await pilot.pause()
        assert app.focused is views[0]


async def test_help_lists_the_new_keys(service: StandInService) -> None:
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("f1")
        await _wait(lambda: isinstance(app.screen, HelpScreen))
        labels = {str(label.render()) for label in app.screen.query(".key-label")}
        assert {
            "F3",
            "F5",
            "↑ / ↓ (on a message)",
            "Typing (on a message or the sessions list)",
        } <= labels
        assert "c / b / i (on a message)" not in labels
        assert "Ctrl+B" not in labels
