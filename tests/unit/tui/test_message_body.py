"""A message's Markdown is one widget that draws lines: a page of messages mounts a few
widgets per message whatever their Markdown holds, a streamed reply re-renders only its
last block and ends drawn exactly as the same text stored, and a very long message draws
a part at a time while keys still reach the input (model-free: a host app, no engine)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from textual import events
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Input

from kvchat.tui.widgets import markdown_render
from kvchat.tui.widgets.body import PARTS_CHARS, STREAM_SLACK, MessageBody
from kvchat.tui.widgets.message_view import MessageView, message_parser

REPLY = """\
Here is the plan, in **three** steps:

1. Read the `conversations.json` file.
2. Keep each message's text as written: <b>not bold</b> &amp; more.
3. See https://example.com/docs for the rest.

## The code

```python
def plan(steps):
    return [s for s in steps if s]
```

| step | time |
| --- | --- |
| read | 2 s |
| keep | 1 s |

> Quoted advice, *in italics*.

That is all."""


class Host(App[None]):
    """Messages in a scroll, and an input to type into."""

    def __init__(self, *widgets: object) -> None:
        super().__init__()
        self.widgets = widgets

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="messages"):
            yield from self.widgets  # type: ignore[misc]
        yield Input(id="typing")


async def _until(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_page_of_markdown_replies_mounts_one_widget_per_message() -> None:
    views = [MessageView("assistant", REPLY, number=n) for n in range(1, 13)]
    app = Host(*views)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.pause()
        for view in views:
            # The message draws its role line and its Markdown itself: a list, a table, a
            # fence and a quote add no widgets (Textual's Markdown mounted one per block and
            # item; a container, a label and a body were three per message).
            assert not list(view.query("*")), list(view.query("*"))
            assert view.drawn_lines[0].strip() == f"Assistant · #{view.number}"
        shown = [line.strip() for line in views[0].body.shown_text.splitlines()]
        text = "\n".join(shown)
        assert "**" not in text and "```" not in text and "## " not in text  # rendered
        assert "1. Read the conversations.json file." in shown, shown
        assert "<b>not bold</b> &amp; more." in text  # markup a message holds is text
        assert "https://example.com/docs for the rest." in text  # an address once, as written
        assert "def plan(steps):" in text and "The code" in shown
        assert any(line.startswith("read") and line.endswith("2 s") for line in shown), shown


async def test_a_message_mounted_again_takes_its_rendered_lines_from_the_last_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A switch back to a session mounts its messages again: their Markdown is not rendered
    again (it was most of a switch's layout), and they show the same lines."""
    rendered: list[int] = []
    lines = markdown_render.Renderer.lines

    def counting(self: markdown_render.Renderer, tokens: list[object]) -> list[object]:
        rendered.append(len(tokens))
        return lines(self, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(markdown_render.Renderer, "lines", counting)
    reply = REPLY + "\n\nOnly in this test."  # not rendered by another test before
    first = MessageView("assistant", reply, number=2)
    app = Host(first)
    async with app.run_test(size=(100, 60)) as pilot:
        await pilot.pause()
        assert len(rendered) == 1
        shown = first.drawn_text
        await first.remove()
        again = MessageView("assistant", reply, number=2)
        await app.query_one("#messages").mount(again)
        await pilot.pause()
        assert len(rendered) == 1 and again.drawn_text == shown
        other = MessageView("assistant", reply + " And more.", number=3)
        await app.query_one("#messages").mount(other)
        await pilot.pause()
        assert len(rendered) == 2 and "And more." in other.drawn_text


async def test_a_streamed_reply_renders_its_last_block_only_and_ends_as_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered: list[int] = []  # the number of tokens each render was given
    lines = markdown_render.Renderer.lines

    def counting(self: markdown_render.Renderer, tokens: list[object]) -> list[object]:
        rendered.append(len(tokens))
        return lines(self, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(markdown_render.Renderer, "lines", counting)
    streamed = MessageBody(parser_factory=message_parser)
    app = Host(streamed)
    async with app.run_test(size=(100, 60)) as pilot:
        stream = streamed.start_stream()
        pieces = [REPLY[i : i + 7] for i in range(0, len(REPLY), 7)]
        for piece in pieces:
            await stream.write(piece)
            await pilot.pause()
        # Each piece re-rendered the last block; the ones before it were rendered once.
        whole = len(message_parser().parse(REPLY))
        assert sum(rendered) < len(pieces) * whole / 4, rendered
        stored = MessageBody(REPLY, parser_factory=message_parser)
        await app.query_one("#messages").mount(stored)
        await pilot.pause()
        # Block by block, as whole (and blank lines to grow into, a few at a time).
        assert streamed.shown_text.rstrip() == stored.shown_text.rstrip()
        assert len(streamed.shown_text.split("\n")) % STREAM_SLACK == 0
        await stream.stop()
        await pilot.pause()
        assert streamed.source == REPLY
        assert streamed.shown_text == stored.shown_text  # as the same text stored


async def test_a_very_long_message_draws_in_parts_while_keys_reach_the_input() -> None:
    paragraph = "A line of a very long pasted log, with some words in it.\n\n"
    source = paragraph * (1_000_000 // len(paragraph)) + "The last line."
    assert len(source) > PARTS_CHARS
    big = MessageBody(source, parser_factory=message_parser)
    app = Host(big)
    async with app.run_test(size=(100, 30)):
        typing = app.query_one(Input)
        typing.focus()
        assert not big.rendered and "drawing" in big.shown_text  # a note meanwhile
        for character in "typed":  # as the terminal sends them: no waiting for the app
            key = events.Key(character, character)
            key.set_sender(app)
            assert app._driver is not None
            app._driver.send_message(key)
        await _until(lambda: typing.value == "typed")
        typed_while_drawing = not big.rendered
        await _until(lambda: big.rendered, 120)
        assert typed_while_drawing  # the keys were taken before the message was drawn
        assert big.shown_text.rstrip().endswith("The last line.")
        await _until(lambda: big.size.height > 10_000)  # laid out at its whole height
