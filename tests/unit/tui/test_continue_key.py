"""Continue is a key and in the command palette."""

from __future__ import annotations

from kvchat.tui.main import MainScreen
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)


def test_continue_is_a_key_and_in_the_palette() -> None:
    from kvchat.tui.keys import KEYS
    from kvchat.tui.palette import KvchatCommands

    key = next(k for k in KEYS if k.action == "continue_reply")
    assert key.keys == "f12" and key.palette
    entries = {action for _, action, _ in KvchatCommands._entries(None)}  # type: ignore[arg-type]
    assert "continue_reply" in entries
    assert hasattr(MainScreen, "action_continue_reply")
