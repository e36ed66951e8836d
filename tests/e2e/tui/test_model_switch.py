"""Picking a model inside the app: a switch without a restart (the hot session saved, a
failed load leaving the old model loaded and answering), and sessions that remember their
model, in the service and in the real app.

The second model is a tiny random-weight llama GGUF (tests/tiny_models.py) in the models
dir kvchat downloads into; the app's replies that are checked come from the bundled model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.widgets import Label, OptionList

from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path, models_dir
from kvchat.service.chat import ChatService
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.model_picker import ModelScreen
from tests.tiny_models import FAMILIES, write_tiny

TINY = "tiny-llama"


def settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"temperature": 0, "max_tokens": 12, "n_ctx": 1024, "n_threads": 1}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def tiny(kvhome: Path) -> Path:
    """A second model: a tiny llama GGUF in this home's models dir."""
    folder = models_dir()
    folder.mkdir(parents=True)
    return write_tiny(FAMILIES["llama-gqa"], folder / f"{TINY}.gguf")


def bundled() -> Path:
    path = bundled_model_path()
    assert path is not None
    return path


def test_switch_model_and_back_and_each_session_remembers_its_model(tiny: Path) -> None:
    service = ChatService(settings())
    try:
        first = service.start("Name a colour.")
        assert first.reply.strip()
        remembered = service.models.session_model(first.session_id)
        assert remembered is not None and remembered.loaded and remembered.present
        assert remembered.path == bundled().resolve()

        assert service.models.switch_model(TINY + ".gguf") == tiny
        assert service.host.loaded_model_path == tiny
        assert service.engine.config.model_path == tiny
        other = service.sessions.new_session()
        service.send(other.id, "Hello there")
        on_tiny = service.models.session_model(other.id)
        assert on_tiny is not None and on_tiny.name == TINY and on_tiny.loaded
        before = service.models.session_model(first.session_id)
        assert before is not None and before.path == bundled().resolve()
        assert before.present and not before.loaded
        assert [c.name for c in service.models.model_choices() if c.loaded] == [f"{TINY}.gguf"]

        assert service.models.switch_model("bundled") == bundled()
        again = service.send(first.session_id, "And another colour?")
        assert again.reply.strip()
        # The session's KV saved before the first switch comes back for the same model.
        assert again.restore.source in ("ram", "disk"), again.restore
        back = service.models.session_model(first.session_id)
        assert back is not None and back.loaded
        tiny_session = service.models.session_model(other.id)
        assert tiny_session is not None and not tiny_session.loaded
    finally:
        service.close()


def test_a_missing_or_unloadable_model_is_a_clear_error_and_the_old_model_still_answers(
    kvhome: Path, tmp_path: Path
) -> None:
    service = ChatService(settings())
    try:
        session = service.sessions.new_session()
        assert service.send(session.id, "Say hello.").reply.strip()
        with pytest.raises(KvchatError, match="model file not found") as missing:
            service.models.switch_model(tmp_path / "nowhere.gguf")
        assert "\n" not in str(missing.value)
        with pytest.raises(KvchatError, match="in the catalog but not downloaded"):
            service.models.switch_model("qwen2.5-3b")
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(b"GGUF" + bytes(64))
        with pytest.raises(KvchatError) as failed:
            service.models.switch_model(broken)
        message = str(failed.value)
        assert message.startswith("cannot load broken.gguf") and "\n" not in message
        assert f"still on {bundled().stem}" in message
        assert broken.read_bytes() == b"GGUF" + bytes(64)  # the user's file is only read
        assert service.host.loaded_model_path == bundled()
        report = service.send(session.id, "Say hello again.")
        assert report.reply.strip()
    finally:
        service.close()


# ---------------------------------------------------------------------------- the app


async def wait_until(predicate: Callable[[], object], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        await asyncio.sleep(0.05)


async def test_pick_another_model_in_the_app_and_sessions_remember_theirs(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # The session's model is named, not loaded, when it is opened (the setting off; the
    # setting on: test_session_opens_with_its_model.py).
    app = KvchatApp(
        settings(model=str(tiny), max_tokens=16, n_ctx=2048, open_with_session_model=False),
        cursor_blink=False,
    )
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        await wait_until(lambda: main.ready)
        assert main.status.model_name == TINY

        async def send(text: str) -> str:
            main.prompt.focus()
            main.prompt.insert(text)
            before = main.last_turn
            await pilot.press("enter")
            await wait_until(lambda: main.last_turn is not before and main.turn is None)
            await wait_until(lambda: main.housekeeping_idle)  # the settle and the save
            await pilot.pause()
            return main.conversation.views[-1].text

        await send("Hello tiny model")  # random weights: any reply will do
        on_tiny = main.session_id
        await pilot.press("ctrl+n")
        await wait_until(lambda: main.session_id != on_tiny)

        await pilot.press("f9")
        await wait_until(lambda: isinstance(app.screen, ModelScreen))
        picker = app.screen
        assert isinstance(picker, ModelScreen)
        await pilot.pause()
        assert picker.highlighted_choice is not None and picker.highlighted_choice.loaded
        target = next(i for i, c in enumerate(picker.choices) if c.source == "bundled")
        picker.query_one("#model-list", OptionList).highlighted = target
        await pilot.press("enter")
        await wait_until(lambda: main.ready and main.status.model_name == bundled().stem)
        model_label = main.status.query_one("#status-model", Label)
        assert bundled().stem[:20] in str(model_label.render())
        assert main.status.n_ctx == 2048

        reply = await send("Name a fruit.")
        assert reply.strip()
        on_smol = main.session_id
        assert app.service is not None
        remembered = app.service.models.session_model(on_smol or "")
        assert remembered is not None and remembered.loaded

        # Back in the first session: the status line names the model it was made with, and
        # the picker pre-selects it (no switch until the user picks).
        main.open_session(on_tiny or "")
        turn_line = main.status.query_one("#status-turn", Label)
        await wait_until(lambda: TINY in str(turn_line.render()))
        assert main.status.model_name == bundled().stem
        await pilot.press("f9")
        await wait_until(lambda: isinstance(app.screen, ModelScreen))
        await pilot.pause()
        picker = app.screen
        assert isinstance(picker, ModelScreen)
        chosen = picker.highlighted_choice
        assert chosen is not None and chosen.path == tiny
        await pilot.press("escape")
        await wait_until(lambda: not isinstance(app.screen, ModelScreen))
        assert main.status.model_name == bundled().stem
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert app.worker_errors == []


async def test_a_model_that_does_not_load_leaves_the_app_on_its_model(
    kvhome: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    models_dir().mkdir(parents=True)
    broken = models_dir() / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    app = KvchatApp(settings(max_tokens=16, n_ctx=2048), cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        await wait_until(lambda: main.ready)
        await pilot.press("f9")
        await wait_until(lambda: isinstance(app.screen, ModelScreen))
        picker = app.screen
        assert isinstance(picker, ModelScreen)
        await pilot.pause()
        target = next(i for i, c in enumerate(picker.choices) if c.path == broken)
        assert picker.choices[target].fit.startswith("not a readable GGUF file")
        picker.query_one("#model-list", OptionList).highlighted = target
        await pilot.press("enter")
        await wait_until(
            lambda: any("cannot load broken.gguf" in str(n.message) for n in app._notifications)
        )
        await wait_until(lambda: main.ready)
        assert main.status.model_name == bundled().stem
        main.prompt.focus()
        main.prompt.insert("Name a fruit.")
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not None and main.turn is None)
        await pilot.pause()
        assert main.conversation.views[-1].role == "assistant"
        assert main.conversation.views[-1].text.strip()
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert broken.read_bytes() == b"GGUF" + bytes(64)
    assert app.worker_errors == []
