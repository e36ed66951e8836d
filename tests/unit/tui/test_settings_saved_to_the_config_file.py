"""What the user picks in the app is saved to the config file (kvchat.config_file): only
those keys, in place, comments and tables kept, written atomically and readable by the
owner only; a file that is not TOML is never touched."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.config_file import save_config_values, with_values
from kvchat.errors import KvchatError
from kvchat.paths import config_file

USERS_FILE = """\
# my kvchat settings
temperature = 0.5   # warmer
theme = "nord"  # picked long ago

[mcp.servers.files]
command = "files-server"
theme = "not this one"
"""


def test_keys_are_replaced_in_place_and_the_rest_is_kept() -> None:
    text = with_values(USERS_FILE, {"theme": "gruvbox", "model": "ollama:gemma3:270m"})
    lines = text.splitlines()
    assert lines[0] == "# my kvchat settings"
    assert lines[1] == "temperature = 0.5   # warmer"
    assert lines[2] == 'theme = "gruvbox"  # picked long ago'
    assert lines[3] == 'model = "ollama:gemma3:270m"'  # new: above the first table
    parsed = tomllib.loads(text)
    assert parsed["theme"] == "gruvbox" and parsed["model"] == "ollama:gemma3:270m"
    assert parsed["mcp"]["servers"]["files"]["theme"] == "not this one"
    assert text.endswith('theme = "not this one"\n')


def test_values_are_toml_strings_whatever_they_hold() -> None:
    hostile = 'a "quoted" \\ name # not a comment\t\u00e9'
    text = with_values("", {"model": hostile, "open_with_session_model": False})
    assert tomllib.loads(text) == {"model": hostile, "open_with_session_model": False}
    again = with_values(text, {"model": "bundled"})
    assert tomllib.loads(again) == {"model": "bundled", "open_with_session_model": False}


def test_saved_atomically_private_and_read_back_by_the_settings(kvhome: Path) -> None:
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(USERS_FILE)
    assert save_config_values({"theme": "gruvbox", "model": "bundled"}) == path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    settings = load_settings()
    assert settings.theme == "gruvbox" and settings.model == "bundled"
    assert settings.temperature == 0.5
    assert "# warmer" in path.read_text()


def test_a_file_that_is_not_toml_is_left_alone_with_one_line(kvhome: Path) -> None:
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("theme = [unclosed\n")
    with pytest.raises(KvchatError, match="is not valid TOML") as refused:
        save_config_values({"theme": "nord"})
    assert "\n" not in str(refused.value)
    assert path.read_text() == "theme = [unclosed\n"
    with pytest.raises(KvchatError, match="does not write"):
        save_config_values({"n_ctx": "1"})  # type: ignore[dict-item]
