"""A session opens with the model it was made with (issue 41, item 4), named as the user
found it: a session made with a model in Ollama's store (a tiny random-weight llama GGUF in
a fake store, tests/unit/planner/test_model_stores.py) reopens in the app with that model
loaded, the status bar names it ollama:tiny:latest, the app says so, and the next message
decodes only itself. A switch away (F9) and back right after a reply leaves the session's
KV whole: the message after it reads only itself too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.widgets import OptionList

from kvchat.config import Settings, load_settings
from kvchat.service.chat import ChatService
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.screens.model_picker import ModelScreen
from tests.unit.planner.test_model_stores import stores, tiny

__all__ = ["stores", "tiny"]  # fixtures shared with the module they come from

STORE_NAME = "ollama:tiny:latest"


def settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"temperature": 0, "max_tokens": 8, "n_ctx": 1024, "n_threads": 1}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


async def wait_until(predicate: Callable[[], object], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        await asyncio.sleep(0.05)


@pytest.fixture
def made_on_ollama(stores: Path, kvhome: Path) -> str:
    """A session whose two turns ran on ollama:tiny, open when the app last quit."""
    service = ChatService(load_settings(model="ollama:tiny", max_tokens=8, n_threads=1))
    try:
        first = service.start("Hello tiny model")
        service.send(first.session_id, "And again")
        service.sessions.remember_open(first.session_id)
        return first.session_id
    finally:
        service.close()


async def send(main: MainScreen, press: Callable[[str], object], text: str) -> None:
    main.prompt.focus()
    main.prompt.insert(text)
    before = main.last_turn
    await press("enter")  # type: ignore[misc]
    await wait_until(lambda: main.last_turn is not before and main.turn is None)


async def test_a_session_reopens_with_its_model_named_by_its_store_name(
    made_on_ollama: str,
) -> None:
    app = KvchatApp(settings(), cursor_blink=False)  # the default model: the bundled one
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        await wait_until(lambda: main.ready and main.last_restore is not None)
        assert main.session_id == made_on_ollama
        assert main.status.model_name == STORE_NAME
        said = f"Loaded {STORE_NAME}, the model this session was made with"
        assert any(str(n.message).startswith(said) for n in app._notifications)
        assert said in main.status.turn_text
        restore = main.last_restore
        assert restore is not None and restore.source == "disk" and restore.tokens > 0
        await send(main, pilot.press, "Third message")
        report = main.last_report
        assert report is not None
        assert report.tokens.reused == restore.tokens
        assert report.tokens.decoded == report.tokens.prompt - restore.tokens
        details = app.service.models.session_model(made_on_ollama) if app.service else None
        assert details is not None and details.name == STORE_NAME and details.loaded

        # F9 away right after a reply (its settle and snapshot may still be pending) and
        # back: the next message reads only itself.
        before = report
        for target in ("bundled", STORE_NAME):
            await pilot.press("f9")
            await wait_until(lambda: isinstance(app.screen, ModelScreen))
            picker = app.screen
            assert isinstance(picker, ModelScreen)
            await pilot.pause()
            index = next(
                i
                for i, c in enumerate(picker.choices)
                if c.name == target or (target == "bundled" and c.source == "bundled")
            )
            picker.query_one("#model-list", OptionList).highlighted = index
            await pilot.press("enter")
            await wait_until(lambda: not isinstance(app.screen, ModelScreen))
            await wait_until(lambda: main.ready and main.hot_id == made_on_ollama)
        assert main.status.model_name == STORE_NAME
        back = main.last_restore
        assert back is not None and back.source in ("ram", "disk")
        # The whole last turn came back: its prompt and its reply.
        assert back.tokens >= before.tokens.prompt + before.tokens.generated
        await send(main, pilot.press, "Fourth message")
        after = main.last_report
        assert after is not None and after.tokens.reused == back.tokens
        assert after.tokens.decoded == after.tokens.prompt - back.tokens
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert app.worker_errors == []


async def test_with_the_setting_off_the_loaded_model_stays_and_the_session_model_is_named(
    made_on_ollama: str,
) -> None:
    app = KvchatApp(settings(open_with_session_model=False), cursor_blink=False)
    async with app.run_test(size=(100, 30)):
        main = app.main
        await wait_until(lambda: main.ready and main.last_restore is not None)
        assert main.status.model_name.startswith("SmolLM2")
        await wait_until(lambda: f"made with {STORE_NAME}" in main.status.turn_text)
        assert "sha256" not in main.status.turn_text
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert app.worker_errors == []
