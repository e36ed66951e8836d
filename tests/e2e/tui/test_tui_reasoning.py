"""Thinking models in the app: a reply's reasoning shows folded above its answer
("Thought · …") until ``t`` or a click unfolds it, streams into that block while the
status line says the model is thinking, never shows its markers in the answer, and
Ctrl+/ turns the session's thinking off and on through the template's own switch.

The real engine (the bundled model) with the chat templates of tests/e2e/reasoning/test_reasoning.py;
a streamed reply's reasoning is forced with a grammar, so the model generates it token by
token through the app as any reply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from kvchat.tui.widgets.conversation import MessageView
from kvchat.tui.widgets.thought import Thought, ThoughtFigures, thought_line
from tests.e2e.reasoning.test_reasoning import ANSWER, REASONING, SWITCHED, forced
from tests.e2e.tui.test_tui import (
    SIZE,
    make_app,
    open_id,
    quit_app,
    ready,
    send,
    service_of,
    wait_until,
)
from tests.e2e.tui.test_tui import home as home  # noqa: F401  (the fixture)
from tests.e2e.tui.test_tui import no_background_failures as no_background_failures  # noqa: F401

OTHER_REASONING = "Count: three, four."
LONG_REASONING = "First, two and two.\n\nThen: four, surely."


def test_the_folded_line_counts_tokens_else_characters() -> None:
    assert thought_line("abc", ThoughtFigures(431, 12.2), thinking=False, shown=False) == (
        "▸ Thought for 12 s · 431 tokens"
    )
    assert thought_line("abc", None, thinking=False, shown=True) == "▾ Thought · 3 characters"
    assert thought_line("", ThoughtFigures(1), thinking=True, shown=False) == (
        "▸ Thinking… · 1 token"
    )


def _thought(view: MessageView) -> Thought:
    thought = view.thought
    assert thought is not None
    return thought


def _line(view: MessageView) -> str:
    """The reasoning's line as the message draws it (below its role line)."""
    line = view.drawn_lines[1].strip()
    assert line == _thought(view).line
    return line


async def test_a_stored_reply_shows_its_reasoning_folded_until_t(home: Path) -> None:
    """A reply stored with reasoning: one folded line above the answer (the reasoning's
    text is not on screen); ``t`` unfolds it, ``t`` again folds it, a click too. The
    bundled model's template has no thinking switch: Ctrl+/ says so and changes nothing."""
    service = ChatService(Settings(n_threads=1))
    try:
        session = service.sessions.new_session("Sums").id
        service.store.add_message(session, "user", "What is two and two?", token_count=7)
        service.store.add_message(
            session, "assistant", ANSWER, token_count=12, reasoning=LONG_REASONING
        )
    finally:
        service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == session
        reply = main.conversation.views[-1]
        assert reply.text == ANSWER and reply.reasoning == LONG_REASONING
        assert _line(reply) == f"▸ Thought · {len(LONG_REASONING)} characters"
        thought = _thought(reply)
        assert not thought.shown and thought.body_text == ""
        # The folded line sits between the header and the answer; no reasoning is drawn.
        assert reply.drawn_lines[0].startswith("Assistant") and "Then: four, surely." not in (
            reply.drawn_text
        )
        reply.focus()
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert thought.shown and thought.body_text == LONG_REASONING
        assert _line(reply).startswith("▾ Thought")
        assert "Then: four, surely." in reply.drawn_text  # below its line, above the answer
        assert reply.drawn_text.index("Then: four, surely.") < reply.drawn_text.index(ANSWER)
        await pilot.press("enter")
        await pilot.pause()
        assert not thought.shown and "Then: four, surely." not in reply.drawn_text
        # A click on the line unfolds it (the role line is row 0 of the message's content).
        await pilot.click(reply, offset=(4, 1))
        await pilot.pause()
        assert thought.shown and "Then: four, surely." in reply.drawn_text
        # Your message has none; the reply's answer never holds the reasoning.
        assert main.conversation.views[0].thought is None
        assert LONG_REASONING not in reply.body.source
        main.prompt.focus()
        await pilot.press("ctrl+underscore")
        await pilot.pause()
        await _settled(main)
        assert "no thinking switch" in main.status.turn_text
        settings = service_of(app).sessions.resolve(session).settings
        assert "think" not in settings
        await quit_app(app)


async def _settled(main: Any) -> None:
    await wait_until(lambda: not any(w.is_running for w in main.workers if w.group == "action"))


async def test_a_streamed_reply_thinks_folded_and_the_key_switches_thinking(
    home: Path, tmp_path: Path
) -> None:
    """A thinking model's reply forced to reason: the status line says thinking… while it
    does, the reasoning goes into the folded block (counted in tokens, timed), the answer
    into the body without the markers; stored apart. Ctrl+/ turns the session's thinking
    off (the template's enable_thinking), then on again."""
    template = tmp_path / "template.jinja"
    template.write_text(SWITCHED, encoding="utf-8")
    app = make_app(chat_template=str(template), max_tokens=48)
    written = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)
        answer = service.answer

        def forced_answer(*args: Any, **kwargs: Any) -> Any:
            return answer(*args, grammar=forced(written), **kwargs)

        service.answer = forced_answer  # type: ignore[method-assign]
        said: list[str] = []
        set_turn = main.status.set_turn

        def record(text: str, kind: str = "") -> None:
            said.append(text)
            set_turn(text, kind)

        main.status.set_turn = record  # type: ignore[method-assign]
        lines: list[str] = []
        view_write = MessageView.write

        async def write(view: MessageView, text: str) -> None:
            thought = view.thought
            if thought is not None:
                lines.append(thought.line)
            assert "<" not in text and "think" not in text
            await view_write(view, text)

        blocks: list[tuple[bool, bool, str]] = []
        view_reasoning = MessageView.set_reasoning

        async def set_reasoning(view: MessageView, reasoning: str, *args: Any, **kw: Any) -> None:
            await view_reasoning(view, reasoning, *args, **kw)
            thought = view.thought
            if thought is not None:
                blocks.append((thought.thinking, thought.shown, thought.line))

        MessageView.write = write  # type: ignore[method-assign]
        MessageView.set_reasoning = set_reasoning  # type: ignore[method-assign]
        try:
            reply = await send(pilot, main, "What is two and two?")
        finally:
            MessageView.write = view_write  # type: ignore[method-assign]
            MessageView.set_reasoning = view_reasoning  # type: ignore[method-assign]
        # The reasoning streamed into the folded block, its line counting up.
        thinking = [line for on, shown, line in blocks if on and not shown]
        assert thinking and all(line.startswith("▸ Thinking… · ") for line in thinking)
        assert len(set(thinking)) > 1, thinking
        assert any(text.startswith("thinking… ·") for text in said), said
        # While the answer streamed, the reasoning stayed folded above it.
        assert lines and all(line.startswith("▸ Thought") for line in lines), lines
        assert reply.text == ANSWER and reply.body.source == ANSWER
        assert reply.reasoning == REASONING
        thought = _thought(reply)
        assert not thought.shown and thought.body_text == ""
        figures = thought.figures
        assert figures.tokens is not None and figures.tokens >= 5
        assert figures.seconds is not None
        report = main.last_report
        assert report is not None and report.reasoning == REASONING
        from kvchat.tui.phrases import turn_lines

        assert any(line.startswith("Re-rendered: ") for line in turn_lines(report))
        assert _line(reply).startswith("▸ Thought for ") and "tokens" in _line(reply)
        assert REASONING not in reply.body.source and "<think>" not in reply.body.source
        stored = service.sessions.messages(open_id(main))[-1]
        assert (stored.content, stored.reasoning) == (ANSWER, REASONING)
        reply.focus()
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert thought.body_text == REASONING
        # Ctrl+/: off, then on again, in the session's settings.
        main.prompt.focus()
        await pilot.press("ctrl+underscore")
        await _settled(main)
        assert service.sessions.resolve(open_id(main)).settings.get("think") is False
        assert "thinking off" in main.status.turn_text
        await pilot.press("ctrl+underscore")
        await _settled(main)
        assert service.sessions.resolve(open_id(main)).settings.get("think") is True
        assert "thinking on" in main.status.turn_text
        # A new version thinks something else; ← shows the first again, with its own.
        regenerate = service.regenerate
        other = f"<think>\n{OTHER_REASONING}\n</think>\n\n{ANSWER}"

        def forced_regenerate(*args: Any, **kwargs: Any) -> Any:
            return regenerate(*args, grammar=forced(other), **kwargs)

        service.regenerate = forced_regenerate  # type: ignore[method-assign]
        before = main.last_turn
        await pilot.press("ctrl+r")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await wait_until(lambda: main.housekeeping_idle)
        await pilot.pause()
        newer = main.conversation.views[-1]
        assert (newer.reasoning, newer.text) == (OTHER_REASONING, ANSWER)
        assert _line(newer).startswith("▸ Thought for ")
        newer.focus()
        await pilot.press("left")
        await wait_until(lambda: newer.version == (1, 2))
        await pilot.pause()
        assert newer.reasoning == REASONING and _thought(newer).figures == figures
        # Opened again in this run, the reply keeps its figures.
        reply = newer
        line = _line(reply)
        await main.opener.show_stored(open_id(main), lazy=False)
        await pilot.pause()
        again = main.conversation.views[-1]
        assert _line(again) == line.replace("▾", "▸")
        await quit_app(app)
