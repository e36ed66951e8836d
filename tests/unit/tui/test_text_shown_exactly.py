"""Pilot tests: the app shows stored and streamed text exactly, and never passes a control
sequence from stored text to the terminal.

They drive the real app over the real service and store, with the deterministic stand-in
for the model from the snapshot tests (what is claimed here is about drawing, not output).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from kvchat.config import Settings
from kvchat.text import visible
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.conversation import MessageView
from tests.unit.tui import test_tui_snapshots as stand_in
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

SIZE = (120, 40)
HTML = "<script>alert(1)</script>"
RUST = "Vec<String> and &[String]"
EXACT = f"Shown as typed: {HTML}\n\nIn Rust: {RUST}"
# Markdown still renders: bold, a list and a code block lose their markup.
FORMATTED = "Some **bold** text.\n\n- one <b>\n- two\n\n```rust\nlet v: Vec<String> = vec![];\n```"
HOSTILE_TITLE = "Evil\x1b]0;x\x07 title\x1b[2J here"


def strips(widget: Widget) -> Iterator[Strip]:
    """The lines a widget and its descendants draw: what reaches the terminal."""
    for node in [widget, *widget.query("*")]:
        width, height = node.outer_size
        if width and height and node.display:
            yield from node.render_lines(Region(0, 0, width, height))


def rendered(widget: Widget) -> str:
    """The text a widget shows, its non-blank lines joined."""
    lines = (strip.text.rstrip() for strip in strips(widget))
    return "\n".join(line for line in lines if line.strip())


@pytest.fixture
def service(kvhome: Path) -> StandInService:
    return StandInService(Settings(n_ctx=8192, n_threads=1))


def views(app: KvchatApp, role: str) -> list[MessageView]:
    return [v for v in app.main.conversation.views if v.role == role]


async def test_stored_messages_show_angle_brackets_and_markdown(service: StandInService) -> None:
    session = service.sessions.new_session("Code talk")
    service.store.add_message(session.id, "user", EXACT, token_count=9)
    service.store.add_message(session.id, "assistant", EXACT, token_count=9)
    service.store.add_message(session.id, "assistant", FORMATTED, token_count=9)
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _settled(pilot)
        user, reply, formatted = app.main.conversation.views
        for view in (user, reply):
            shown = rendered(view)
            assert HTML in shown and RUST in shown, shown
        shown = rendered(formatted)
        assert "bold text." in shown and "**" not in shown  # bold rendered, markers gone
        assert "one <b>" in shown and "two" in shown and "- one" not in shown  # a list
        assert "let v: Vec<String> = vec![];" in shown and "```" not in shown  # a code block


async def test_sent_and_streamed_messages_show_angle_brackets(
    service: StandInService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stand_in, "REPLY", EXACT)  # what the stand-in model replies
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _settled(pilot)
        main = app.main
        main.prompt.insert(EXACT)
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        (user,), (reply,) = views(app, "user"), views(app, "assistant")
        for view in (user, reply):
            shown = rendered(view)
            assert HTML in shown and RUST in shown, shown

        # A reply while it streams, chunk by chunk (an HTML tag split across chunks).
        view = await main.conversation.add(MessageView("assistant", streaming=True))
        view.start_stream()
        chunks = ("Shown as typed: <scr", "ipt>alert(1)</script>\n\nIn Rust: Vec<Str", "ing> and &")
        for chunk in (*chunks, "[String]\n"):
            await view.write(chunk)
        # The stream is drawn at the next flush (later on a busy machine: wait for it).
        await _wait(lambda: HTML in rendered(view) and RUST in rendered(view), 30)
        await view.finish(text=view.text, message_id=None, partial=False)
        await pilot.pause()
        shown = rendered(view)
        assert HTML in shown and RUST in shown, shown


async def test_control_sequences_never_reach_the_terminal(service: StandInService) -> None:
    session = service.sessions.new_session(HOSTILE_TITLE)
    service.store.add_message(session.id, "user", "Hi\x1b[2J there\x1b]0;x\x07!", token_count=3)
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _settled(pilot)
        item = app.main.sessions
        title = rendered(item)
        assert "Evil title here" in title, title
        message = rendered(app.main.conversation.views[0])
        assert "Hi there!" in message, message
        for widget in (item, app.main.conversation):
            for text in (segment.text for strip in strips(widget) for segment in strip):
                assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text), repr(text)


def test_visible_drops_escape_sequences_and_controls() -> None:
    assert visible(HOSTILE_TITLE) == "Evil title here"
    assert visible("a\tb\nc\r\nd\x00\x7f\x9b") == "a\tb\nc\nd"
    assert visible("bell\x07 and C1 CSI \x9b31m") == "bell and C1 CSI "
    assert visible("stray \x1b]0;not closed") == "stray 0;not closed"  # no text vanishes
    assert visible(EXACT) == EXACT
