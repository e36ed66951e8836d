"""Dialogs and the app's exit status: export defaults to the data dir and never overwrites
silently, the settings dialog refuses values out of range (one set of ranges), system
prompt presets come from the config file, and the app exits non-zero after its error
screen. The real app over the real service and store, with the snapshot tests' stand-in
for the model."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from textual.widgets import Input, Label, Select, TextArea

from kvchat.config import Settings
from kvchat.limits import sampling_problem
from kvchat.tui import app as app_module
from kvchat.tui.app import EXIT_FATAL, KvchatApp, run_app
from kvchat.tui.screens.dialogs import ConfirmDialog, ExportDialog, SettingsDialog
from kvchat.tui.screens.error import ErrorScreen
from tests.unit.tui.test_keys_and_copy import SIZE, notices, service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from


# --- item 8: dialogs and the exit status ----------------------------------------------------


async def test_export_defaults_to_the_data_dir_and_never_overwrites_silently(
    service: StandInService, kvhome: Path
) -> None:
    session = service.sessions.new_session("Travel")
    service.store.add_message(session.id, "user", "Where is the Eiffel tower?", token_count=7)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        path_input = app.screen.query_one("#path", Input)
        default = kvhome / "exports" / "travel.md"
        assert path_input.value == str(default)
        assert path_input.has_focus and path_input.selection.is_empty  # not select-all
        assert path_input.cursor_position == len(path_input.value)
        await pilot.press("enter")
        await _wait(lambda: default.exists())
        assert default.read_text().startswith("# Travel")
        assert stat.S_IMODE(default.stat().st_mode) == 0o600
        assert stat.S_IMODE(default.parent.stat().st_mode) == 0o700

        # Again: a free name by default.
        await _wait(lambda: app.screen is app.main)
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        path_input = app.screen.query_one("#path", Input)
        assert path_input.value == str(kvhome / "exports" / "travel-2.md")
        # An existing file: asked first; "n" keeps it, "y" replaces it.
        default.write_text("keep me")
        path_input.value = str(default)
        await pilot.press("enter")
        await _wait(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("n")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        assert default.read_text() == "keep me"
        await pilot.press("enter")
        await _wait(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await _wait(lambda: default.read_text().startswith("# Travel"))
        assert not (kvhome / "exports" / "travel-2.md").exists()


async def test_settings_dialog_refuses_values_out_of_range(service: StandInService) -> None:
    session = service.sessions.new_session("Tuning")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        dialog = app.screen
        error = dialog.query_one("#settings-error", Label)
        fields = {
            k: dialog.query_one(f"#set-{k}", Input) for k in ("temperature", "top_p", "max_tokens")
        }
        cases = [
            ({"temperature": "120"}, "temperature must be from 0 to 2"),
            ({"temperature": "-1"}, "temperature must be from 0 to 2"),
            ({"temperature": "0.5", "top_p": "0"}, "top_p must be more than 0 and at most 1"),
            ({"top_p": "1.5"}, "top_p must be more than 0"),
            ({"top_p": "0.9", "max_tokens": "0"}, "max_tokens must be a whole number, at least 1"),
            ({"max_tokens": "9000"}, "at most the context length (8,192 tokens)"),
        ]
        for values, message in cases:
            for key, value in values.items():
                fields[key].value = value
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.screen is dialog, values
            assert message in str(error.content), (values, error.content)
            assert error.display
        fields["max_tokens"].value = "100"
        await pilot.press("ctrl+s")
        await _wait(lambda: app.screen is app.main)
        await _wait(lambda: service.sessions.resolve(session.id).settings != {})
        assert service.sessions.resolve(session.id).settings == {
            "temperature": 0.5,
            "top_p": 0.9,
            "max_tokens": 100,
        }


def test_limits_are_one_set_of_ranges() -> None:
    assert sampling_problem("temperature", 0) is None
    assert sampling_problem("temperature", 2) is None
    assert sampling_problem("temperature", 2.01) is not None
    assert sampling_problem("top_p", 1) is None and sampling_problem("top_p", 0) is not None
    assert sampling_problem("max_tokens", 1) is None
    assert sampling_problem("max_tokens", 4096, n_ctx=4096) is None
    assert sampling_problem("max_tokens", 4097, n_ctx=4096) is not None
    assert sampling_problem("seed", -1) is not None and sampling_problem("seed", 0) is None


async def test_the_app_exits_non_zero_after_its_error_screen(kvhome: Path, tmp_path: Path) -> None:
    settings = Settings(model=str(tmp_path / "missing.gguf"), n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _wait(lambda: isinstance(app.screen, ErrorScreen), 60)
        await pilot.pause()
        app.simulate_key("q")
        await _wait(lambda: app._closed, 30)
    assert app.return_code == EXIT_FATAL != 0


def test_run_app_exits_with_the_apps_status(monkeypatch: pytest.MonkeyPatch) -> None:
    class Finished:
        def __init__(self, settings: Settings) -> None:
            self.return_code: int | None = None

        def run(self) -> None:
            self.return_code = code

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(app_module, "KvchatApp", Finished)
    code = EXIT_FATAL
    with pytest.raises(SystemExit) as exited:
        run_app(Settings(n_threads=1))
    assert exited.value.code == EXIT_FATAL
    code = 0
    assert run_app(Settings(n_threads=1)) == 0


# --- item 14: system prompt presets ---------------------------------------------------------


async def test_settings_offer_system_prompt_presets_from_the_config_file(kvhome: Path) -> None:
    kvhome.mkdir(parents=True, exist_ok=True)
    (kvhome / "config.toml").write_text(
        'temperature = 0.3\n\n[presets]\npirate = "Answer like a pirate."\nbad = 3\n'
    )
    service = StandInService(Settings(n_ctx=8192, n_threads=1))  # the table is no setting
    assert service.host.settings.temperature == 0.3
    session = service.sessions.new_session("Ahoy")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        dialog = app.screen
        select = dialog.query_one("#preset", Select)
        names = [str(prompt) for prompt, _ in select._options if _ is not Select.NULL]
        assert {"Concise", "Programmer", "pirate"} <= set(names) and "bad" not in names
        assert any("not text were skipped: bad" in n for n in notices(app))
        select.value = "pirate"
        await pilot.pause()
        assert dialog.query_one("#system-prompt", TextArea).text == "Answer like a pirate."
        await pilot.press("ctrl+s")
        await _wait(
            lambda: service.sessions.resolve(session.id).system_prompt == "Answer like a pirate."
        )
        await _wait(lambda: app.screen is app.main)
        await pilot.press("ctrl+g")  # the preset in use is shown as picked
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#preset", Select).value == "pirate"
