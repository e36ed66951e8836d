"""Small things (issue 41, item 9) in the real app with the snapshot tests' stand-in for the
model: the status line at 120 and 80 columns, toasts clear of the input at 80×24, Ctrl+G's
Save/Cancel on an 80×24 screen and its fields that look editable, F1's scrollbar, Esc that
closes a dialog and does not then stop the reply, the export dialog's Down+Enter, and the
KV badge that says when it saves."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from textual.geometry import Region
from textual.widgets import Button, Input, Label
from textual.widgets._toast import Toast

from kvchat.config import Settings
from kvchat.kvcache.tiers import SnapshotWrite
from kvchat.tui.phrases import snapshot_phrase
from kvchat.tui.screens.dialogs import ExportDialog, SettingsDialog
from kvchat.tui.screens.help import HelpScreen
from tests.unit.tui.test_keys_and_copy import notices, service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from

# A first turn's summary cut at the token limit, as the app shows it (the hint last).
SUMMARY = (
    "full prefill: no snapshot saved for this session yet · decoded 1,234 · first token "
    "2,345 ms · 41 tok/s · KV saved whole: the layout could not be cut · stopped at the "
    "token limit · F12 continues it"
)


def _seed(service: StandInService) -> str:
    session = service.sessions.new_session("Small things")
    service.store.add_message(session.id, "user", "Hi", token_count=3)
    service.store.add_message(session.id, "assistant", "Hello", token_count=4)
    return session.id


def _shown(label: Label) -> str:
    return str(label.render())


@pytest.mark.parametrize("size", [(120, 35), (80, 24)], ids=["120x35", "80x24"])
async def test_the_status_line_fits_and_keeps_its_hint(
    service: StandInService, size: tuple[int, int]
) -> None:
    _seed(service)
    app, run = start(service, size=size)
    async with run as pilot:
        await _settled(pilot)
        status = app.main.status
        status.set_memory("KV: hot · saves when you pause", "hot")
        status.set_turn(SUMMARY, "warning")
        await pilot.pause()
        turn = status.query_one("#status-turn", Label)
        shown = _shown(turn)
        assert shown.endswith("F12 continues it") and shown.startswith("full prefill")
        assert cell_len(shown) <= turn.content_size.width
        memory = status.query_one("#status-memory", Label)
        assert cell_len(_shown(memory)) <= memory.content_size.width, _shown(memory)
        assert memory.region.right <= size[0]


async def test_toasts_do_not_cover_the_input_at_80x24(service: StandInService) -> None:
    _seed(service)
    app, _ = start(service)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await _settled(pilot)
        for i in range(3):
            app.notify(f"Notice {i}: " + "a long line of words " * 4, timeout=30)
        await _wait(lambda: len(app.screen.query(Toast)) == 3)
        await pilot.pause()
        prompt = app.main.prompt.region
        for toast in app.screen.query(Toast):
            assert not toast.region.overlaps(prompt), (toast.region, prompt)


async def test_ctrl_g_save_and_cancel_are_on_an_80x24_screen(service: StandInService) -> None:
    _seed(service)
    app, run = start(service, size=(80, 24))
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        await pilot.pause()
        dialog = app.screen
        box = dialog.query_one("#settings-dialog").content_region  # inside border and padding
        screen = Region(0, 0, 80, 24)
        for button in dialog.query(Button):
            assert screen.contains_region(button.region), (button.id, button.region)
            assert box.contains_region(button.region), (button.id, button.region, box)
        # The fields scroll inside (more of them than 80×24 shows); each looks editable.
        assert dialog.query_one("#settings-fields").max_scroll_y > 0
        well = dialog.query_one("#set-temperature", Input).styles.background
        assert well != dialog.query_one("#settings-dialog").styles.background
        # A refusal's line does not push them off either.
        dialog.query_one("#set-temperature", Input).value = "9"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert dialog.query_one("#settings-error").has_class("-shown")
        box = dialog.query_one("#settings-dialog").content_region
        for button in dialog.query(Button):
            assert box.contains_region(button.region), (button.id, button.region, box)
        await pilot.click("#cancel")  # reachable: the click lands on it
        await _wait(lambda: app.screen is app.main)


async def test_f1_help_scrolls_with_a_scrollbar(service: StandInService) -> None:
    app, run = start(service, size=(80, 24))
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("f1")
        await _wait(lambda: isinstance(app.screen, HelpScreen))
        await pilot.pause()
        keys = app.screen.query_one("#keys")
        assert keys.max_scroll_y > 0 and keys.show_vertical_scrollbar
        assert keys.scrollbar_size_vertical == 1
        assert keys.styles.scrollbar_background != keys.styles.background


class SlowReplyService(StandInService):
    """The stand-in whose reply waits for ``release`` (a reply streaming for a while)."""

    release: threading.Event

    def answer(self, session_id: str, message_id: int, **kwargs: Any) -> Any:
        self.release.wait(30)
        return super().answer(session_id, message_id, **kwargs)


@pytest.fixture
def slow(kvhome: Path) -> SlowReplyService:
    made = SlowReplyService(Settings(n_ctx=8192, n_threads=1))
    made.release = threading.Event()
    return made


async def test_esc_closes_the_dialog_and_not_the_reply_too(slow: SlowReplyService) -> None:
    _seed(slow)
    app, run = start(slow)
    try:
        async with run as pilot:
            await _settled(pilot)
            main = app.main
            main.prompt.insert("Tell me more")
            await pilot.press("enter")
            await _wait(lambda: main.turn is not None)
            turn = main.turn
            assert turn is not None
            await pilot.press("f1")
            await _wait(lambda: isinstance(app.screen, HelpScreen))
            await pilot.press("escape", "escape", "escape")  # one meant for the dialog, then more
            await pilot.pause()
            assert app.screen is main and not turn.cancel.is_set()
            assert any("Esc in a moment stops the reply" in n for n in notices(app))
            await pilot.pause(1.1)
            await pilot.press("escape")  # now it is meant for the reply
            assert turn.cancel.is_set()
            slow.release.set()
            await _wait(lambda: main.turn is None)
    finally:
        slow.release.set()


async def test_down_then_enter_exports_the_second_format(
    service: StandInService, kvhome: Path
) -> None:
    session_id = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        await pilot.pause()
        await pilot.press("down", "enter")
        await _wait(lambda: any(n.startswith("Exported to ") for n in notices(app)))
        path = Path(next(n for n in notices(app) if n.startswith("Exported to "))[12:])
        assert path.suffix == ".json"
        assert path.read_text(encoding="utf-8") == service.sessions.export(session_id, "json")
        # On the formats themselves: Down, Enter picks it and goes back to the path.
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        dialog = app.screen
        await pilot.press("shift+tab")  # from the path to the formats
        await pilot.press("down", "down", "enter")
        await pilot.pause()
        assert dialog.fmt == "html" and app.focused is dialog.query_one("#path", Input)


def test_the_kv_badge_says_when_it_saves() -> None:
    assert snapshot_phrase(SnapshotWrite()) == "saves when you pause"
