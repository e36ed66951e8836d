"""The theme picked in the app (Ctrl+P, 'Change theme') is saved to the config file, said
where, and is the theme after a relaunch on the same home (the stand-in service of
test_tui_snapshots: the real app, store and settings, no model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from kvchat.config import Settings
from kvchat.paths import config_file
from kvchat.tui.app import KvchatApp
from tests.unit.tui.test_tui_snapshots import StandInService

SIZE = (100, 30)


async def wait_until(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        await asyncio.sleep(0.02)


def make_app() -> KvchatApp:
    service = StandInService(Settings(n_ctx=8192, n_threads=1))  # reads the config file
    return KvchatApp(service.host.settings, service, cursor_blink=False)


async def test_a_theme_picked_in_the_palette_is_the_theme_after_a_relaunch(kvhome: Path) -> None:
    first = make_app()
    async with first.run_test(size=SIZE) as pilot:
        await wait_until(lambda: first.main.ready)
        assert first.theme == "textual-dark"
        await pilot.press("ctrl+p")
        await pilot.press(*"theme")
        await pilot.pause(0.3)
        await pilot.press("enter")  # "Theme": the theme list
        await pilot.pause(0.3)
        await pilot.press(*"nord")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(lambda: first.theme == "nord")
        path = config_file()
        said = f"Theme nord saved to {path}"
        await wait_until(lambda: any(n.message == said for n in first._notifications))
        assert 'theme = "nord"' in path.read_text()
        first.simulate_key("ctrl+q")
        await wait_until(lambda: first._closed)

    again = make_app()
    async with again.run_test(size=SIZE):
        await wait_until(lambda: again.main.ready)
        assert again.theme == "nord"
        assert not any("saved to" in str(n.message) for n in again._notifications)
        again.simulate_key("ctrl+q")
        await wait_until(lambda: again._closed)
