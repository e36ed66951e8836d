"""The key table is the single source of the bindings, the help screen, the palette and KEYS.md."""

from __future__ import annotations

from pathlib import Path

from kvchat.tui.app import KvchatApp
from kvchat.tui.keys import KEYS, bindings, keys_markdown
from kvchat.tui.main import MainScreen
from kvchat.tui.palette import KvchatCommands
from kvchat.tui.phrases import ago, code_blocks, gauge

KEYS_MD = Path(__file__).resolve().parents[3] / "app" / "kvchat" / "tui" / "KEYS.md"


def test_keys_md_is_generated_from_the_key_table() -> None:
    assert keys_markdown() in KEYS_MD.read_text(encoding="utf-8")


def test_every_bound_action_exists() -> None:
    for binding in bindings():
        action = binding.action
        if action.startswith("app."):
            assert hasattr(KvchatApp, f"action_{action[4:]}"), action
        else:
            assert hasattr(MainScreen, f"action_{action}"), action
    keys = {b.key for b in bindings()}
    expected = {
        "escape",
        "ctrl+n",
        "f2",
        "f8",
        "ctrl+f",
        "ctrl+s",
        "ctrl+g",
        "ctrl+r",
        "f1",
        "ctrl+t",
        "f4",
    }
    assert expected | {"ctrl+q"} <= keys


def test_every_key_has_a_description_and_palette_actions_have_keys() -> None:
    for key in KEYS:
        assert key.label and key.description
        if key.palette:
            assert key.action and key.keys


def test_branch_and_edit_are_in_the_palette_and_no_typed_key_acts_on_a_message() -> None:
    from kvchat.tui.screens.details import DetailsDialog
    from kvchat.tui.widgets.conversation import MessageView
    from kvchat.tui.widgets.sidebar import SessionList

    entries = {action for _, action, _ in KvchatCommands._entries(None)}  # type: ignore[arg-type]
    assert {"branch", "edit_message", "regenerate", "copy_code", "message_details"} <= entries
    # Where the user may expect to type (a message, the sessions list, a dialog that only
    # shows lines, the main screen), no binding is a key that types a character: only the
    # list's Space and / (they fold and filter it), which the list keeps.
    for cls in (MessageView, SessionList, DetailsDialog, MainScreen):
        for binding in cls.BINDINGS:
            for key in binding.key.split(","):  # type: ignore[union-attr]
                typed = len(key) == 1 or key in ("space", "slash")
                assert not typed or (cls is SessionList and key in ("space", "slash")), (cls, key)


def test_format_helpers() -> None:
    assert gauge(0, 100) == "▱" * 10
    assert gauge(1, 1000) == "▰" + "▱" * 9  # anything used shows
    assert gauge(100, 100) == "▰" * 10
    assert ago("2020-01-01T00:00:00+00:00") == "2020-01-01"
    assert code_blocks("x\n```py\na = 1\n```\ny\n~~~\nb\n~~~\n") == ["a = 1", "b"]
