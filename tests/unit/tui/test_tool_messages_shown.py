"""A tool's result in the conversation: headed as such, folded past a few lines, plain
text (no escapes reach the terminal); the call dialog shows the arguments as text."""

from __future__ import annotations

from textual.app import App
from textual.widgets import Static

from kvchat.service.tools import CallRequest
from kvchat.tui.screens.tool_call import SHOWN_ARGUMENT_CHARS, ToolCallDialog, ToolsDialog
from kvchat.tui.widgets.message_view import TOOL_FOLD_LINES, MessageView


def test_a_long_result_folds_to_its_first_lines() -> None:
    text = "\n".join(f"line {i}" for i in range(30))
    view = MessageView("tool", text, message_id=3, number=3)
    assert view.header.startswith("Tool result · #3")
    assert view.foldable and view.folded
    assert view.body.source.split("\n") == [f"line {i}" for i in range(TOOL_FOLD_LINES)]
    assert view.fold_note == f"⋯ {30 - TOOL_FOLD_LINES} more lines · Enter shows them all"


def test_a_short_result_shows_whole_and_escapes_do_not_reach_the_terminal() -> None:
    view = MessageView("tool", "5\x1b[2J\x07")
    assert not view.foldable
    assert "\x1b" not in view.body.source and "\x07" not in view.body.source


async def test_the_dialog_shows_arguments_cut_as_text_and_answers_by_key() -> None:
    arguments = {"text": "\x1b[31m" + "x" * (SHOWN_ARGUMENT_CHARS * 2)}
    request = CallRequest("s", "demo.add", arguments, "c1", "Adds.\nTwo lines")
    answers: list[object] = []

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ToolCallDialog(request), answers.append)

    app = Host()
    async with app.run_test() as pilot:
        shown = str(app.screen.query_one("#tool-arguments-text", Static).content)
        assert "\x1b" not in shown and shown.endswith("more characters")
        assert len(shown) < SHOWN_ARGUMENT_CHARS + 100
        await pilot.press("a")
        await pilot.pause()
    assert answers == ["always"]
    assert request.arguments == arguments  # the call gets them all


async def test_escape_denies() -> None:
    answers: list[object] = []

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ToolCallDialog(CallRequest("s", "t.x", {}, "c")), answers.append)

    app = Host()
    async with app.run_test() as pilot:
        await pilot.press("escape")
        await pilot.pause()
    assert answers == ["deny"]


async def test_the_tools_dialog_saves_the_tools_left_on_and_esc_changes_nothing() -> None:
    answers: list[object] = []
    tools = [("demo.add", True), ("demo.[b]bold[/b]", False)]

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ToolsDialog(["demo · running · approve ask"], tools), answers.append)

    app = Host()
    async with app.run_test() as pilot:
        await pilot.press("space")  # the first tool, highlighted: off
        await pilot.press("ctrl+s")
        await pilot.pause()
        app.push_screen(ToolsDialog([], tools), answers.append)
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
    assert answers == [set(), None]
