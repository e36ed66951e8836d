"""F9's Ctrl+D makes the highlighted model the default one (issue 41, item 6): saved to the
config file (said where), and the model kvchat loads after a relaunch. The stand-in service
of test_tui_snapshots (no model is loaded; the second model is a tiny GGUF file)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from textual.widgets import OptionList

from kvchat.config import Settings
from kvchat.paths import config_file, models_dir
from kvchat.planner.model_lookup import model_path
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.model_picker import ModelScreen
from tests.tiny_models import FAMILIES, write_tiny
from tests.unit.tui.test_tui_snapshots import StandInService


async def wait_until(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        await asyncio.sleep(0.02)


async def test_ctrl_d_in_the_picker_saves_the_default_model(kvhome: Path) -> None:
    models_dir().mkdir(parents=True)
    tiny = write_tiny(FAMILIES["llama-gqa"], models_dir() / "tiny-llama.gguf")
    service = StandInService(Settings(n_ctx=8192, n_threads=1))
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(lambda: app.main.ready)
        await pilot.press("f9")
        await wait_until(lambda: isinstance(app.screen, ModelScreen))
        picker = app.screen
        assert isinstance(picker, ModelScreen)
        await pilot.pause()
        index = next(i for i, c in enumerate(picker.choices) if c.path == tiny)
        picker.query_one("#model-list", OptionList).highlighted = index
        await pilot.press("ctrl+d")
        path = config_file()
        said = f"tiny-llama is the default model now (model = 'tiny-llama.gguf' in {path})"
        await wait_until(lambda: any(n.message == said for n in app._notifications))
        assert isinstance(app.screen, ModelScreen)  # still open: Enter would load it
        await pilot.press("escape")
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert 'model = "tiny-llama.gguf"' in path.read_text()
    relaunched = Settings()
    assert relaunched.model == "tiny-llama.gguf"
    assert model_path(relaunched) == tiny
