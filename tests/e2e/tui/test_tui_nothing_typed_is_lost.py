"""Nothing typed is lost, on the real app and the real model (SmolLM2-135M), and the rough
edges a newcomer hit in an afternoon are gone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvchat.tui.main.context import REFRESH_SESSIONS
from kvchat.tui.widgets.conversation import MessageView
from tests.e2e.tui.test_tui import SIZE, ready, send, service_of, wait_until
from tests.e2e.tui.test_tui_relaunch_and_continue import header, make_app


def stored(app: object, session_id: str | None) -> list[tuple[str, str]]:
    assert session_id is not None
    return [(m.role, m.content) for m in service_of(app).sessions.messages(session_id)]  # type: ignore[arg-type]


# --- item 1: text typed right after Enter is never lost ---------------------------------------


async def test_the_message_leaves_the_input_at_enter_and_what_is_typed_after_stays(
    kvhome: Path,
) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Alpha: name a colour.")
        # The engine thread is busy (as with housekeeping after a reply, or a restore).
        gate = threading.Event()
        busy = app.engine_thread.run(gate.wait, 60)
        try:
            main.prompt.focus()
            await pilot.press(*"Charlie: name a bird.")
            await pilot.press("enter")
            await pilot.press(*"Delta typed right after Enter")
            # The message left the input at once, and shows as pending.
            assert main.prompt.text == "Delta typed right after Enter"
            asked = [v for v in main.conversation.views if v.role == "user"][-1]
            assert asked.text == "Charlie: name a bird."
            # It is stored while the engine is still busy, and then shows as sent.
            await wait_until(
                lambda: stored(app, main.session_id)[-1] == ("user", "Charlie: name a bird.")
            )
            await wait_until(lambda: not asked.pending)
            assert "sending" not in header(asked)
            assert not gate.is_set() and main.turn is not None
        finally:
            gate.set()
        await busy
        await wait_until(lambda: main.turn is None and main.last_turn is not None)
        await pilot.pause()
        # Answered; what was typed after Enter is still in the input, untouched.
        assert [r for r, _ in stored(app, main.session_id)] == ["user", "assistant"] * 2
        assert main.prompt.text == "Delta typed right after Enter"
        assert [v.role for v in main.conversation.views] == ["user", "assistant"] * 2


async def test_keys_that_reach_the_input_before_the_screen_hears_of_enter_are_kept(
    kvhome: Path,
) -> None:
    """A terminal can deliver the next keys before the screen has handled Enter (seen in
    tmux: a Backspace right after Enter); they belong to the next message."""
    from textual import events

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Hello.")
        main.prompt.focus()
        main.prompt.insert("Name a bird.\n")
        before = main.last_turn
        # Enter, then (before the screen handles the message Enter posted) a Backspace and
        # the start of the next message, as the terminal delivered them.
        await main.prompt._on_key(events.Key("enter", "\r"))
        main.prompt.action_delete_left()
        main.prompt.insert("Next")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await pilot.pause()
        assert stored(app, main.session_id)[-2] == ("user", "Name a bird.")
        assert main.prompt.text == "Next"


async def test_a_message_not_sent_goes_back_to_the_input_above_what_was_typed_since(
    kvhome: Path,
) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Hello.")
        session_id = main.session_id
        assert session_id is not None
        # Another process runs a turn on the session: the message cannot be stored.
        with service_of(app).locks.hold(session_id):
            main.prompt.focus()
            await pilot.press(*"mine")
            await pilot.press("enter")
            assert main.prompt.text == ""  # it left the input at once
            await pilot.press(*"more")
            await wait_until(lambda: "another kvchat is replying" in main.status.turn_text)
            assert main.prompt.text == "mine\nmore"
            assert [v.text for v in main.conversation.views if v.role == "user"] == ["Hello."]
            assert any("back in the input" in n.message for n in app._notifications)
        assert len(stored(app, session_id)) == 2


async def test_a_message_too_long_for_the_context_goes_back_to_the_input(kvhome: Path) -> None:
    app = make_app()  # n_ctx 1024
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Hello.")
        long = "word " * 1500
        main.prompt.focus()
        main.prompt.insert(long)
        await pilot.press("enter")
        await wait_until(lambda: main.turn is None and main.prompt.text.strip())
        await pilot.pause()
        assert main.prompt.text == long.strip()  # as sent: without the trailing blank
        assert len(stored(app, main.session_id)) == 2  # stored, refused, deleted again
        assert [v.role for v in main.conversation.views] == ["user", "assistant"]
        assert not any(isinstance(v, MessageView) and v.pending for v in main.conversation.views)
        assert any("back in the input" in n.message for n in app._notifications)


# --- item 2: your own Markdown renders as written ----------------------------------------------


async def test_your_markdown_renders_without_stray_backslashes_and_tables_render(
    kvhome: Path,
) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        main.prompt.focus()
        lines = [
            "Shopping:",
            "- eggs",
            "## Notes",
            "| item | qty |",
            "| --- | --- |",
            "| eggs | 6 |",
        ]
        for k, line in enumerate(lines):
            if k:
                await pilot.press("ctrl+j")  # a new line in the message
            await pilot.press(*line)
        await pilot.press("enter")
        await wait_until(lambda: any(v.role == "user" for v in main.conversation.views))
        await wait_until(lambda: main.turn is None)
        await pilot.pause()
        mine = next(v for v in main.conversation.views if v.role == "user")
        assert mine.text == "\n".join(lines)  # stored and copied as typed
        shown = [line.strip() for line in mine.body.shown_text.splitlines()]
        assert "• eggs" in shown and "Notes" in shown, shown  # a list, and a heading
        assert not any("#" in line or "\\" in line for line in shown), shown
        assert not any("|" in line for line in shown), shown  # the table is not raw
        header = next(k for k, line in enumerate(shown) if line.startswith("item"))
        assert shown[header].endswith("qty") and set(shown[header + 1]) == {"─"}, shown
        assert shown[header + 2].startswith("eggs") and shown[header + 2].endswith("6"), shown
        assert shown[0] == "Shopping:"

        # Lines of a paragraph keep their breaks (Ctrl+J means a new line).
        main.prompt.insert("first line")
        await pilot.press("ctrl+j")
        await pilot.press(*"second line")
        await pilot.press("enter")
        await wait_until(lambda: main.turn is None and len(main.conversation.views) == 4)
        await pilot.pause()
        second = main.conversation.views[2]
        assert "first line\nsecond line" in second.body.shown_text


# --- item 3: F8 in the sessions list deletes the highlighted session ---------------------------


async def test_f8_in_the_sessions_list_deletes_the_highlighted_session(kvhome: Path) -> None:
    from textual.widgets import Label

    from kvchat.service.chat import ChatService
    from kvchat.tui.screens.dialogs import ConfirmDialog
    from tests.e2e.tui.test_tui_relaunch_and_continue import make_settings

    service = ChatService(make_settings())
    other = service.sessions.new_session("Other chat")
    service.sessions.add_message(other.id, "user", "other question")
    opened = service.sessions.new_session("Open chat")  # the last made: what the app opens
    service.sessions.add_message(opened.id, "user", "open question")
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == opened.id
        await pilot.press("ctrl+l")
        await wait_until(lambda: len(main.sessions.rows) == 2)
        index = next(i for i, r in enumerate(main.sessions.rows) if r.id == other.id)
        while main.sessions.index != index:
            await pilot.press("down" if (main.sessions.index or 0) < index else "up")
        await pilot.press("f8")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        question = str(app.screen.query_one(".dialog-title", Label).render())
        assert "Other chat" in question
        await pilot.press("y")
        await wait_until(lambda: [r.id for r in main.sessions.rows] == [opened.id])
        assert [s.session.id for s in service_of(app).sessions.list_sessions()] == [opened.id]
        assert main.session_id == opened.id
        assert [v.text for v in main.conversation.views] == ["open question"]

        # With the input focused, F8 still means the open session.
        main.prompt.focus()
        await pilot.press("f8")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        assert "Open chat" in str(app.screen.query_one(".dialog-title", Label).render())
        await pilot.press("n")


# --- item 4: why a reply ended is stored with it and shown everywhere --------------------------


async def test_a_reply_cut_by_kvchat_ask_shows_the_mark_in_the_app_and_the_json_export(
    kvhome: Path,
) -> None:
    import json

    from tests.conftest import run_cli_here
    from tests.e2e.tui.test_tui_relaunch_and_continue import quit_app

    prompt = "Write a long poem about the sea."
    asked = run_cli_here(kvhome, "ask", "--max-tokens", "4", "--temperature", "0", prompt)
    assert "stopped at the token limit" in asked.stderr
    sessions = run_cli_here(kvhome, "list", "--json").json
    session_id = sessions[0]["id"]
    exported = json.loads(run_cli_here(kvhome, "export", session_id, "--format", "json").stdout)
    meta = exported["message_meta"]
    assert [m["finish_reason"] for m in meta] == [None, "length"]
    markdown = run_cli_here(kvhome, "export", session_id).stdout
    assert "## Assistant _(stopped at the token limit)_" in markdown

    for _ in range(2):  # a launch, then a restart: the mark comes from the store
        app = make_app()
        async with app.run_test(size=SIZE):
            opened = await ready(app)
            assert opened.session_id == session_id
            shown = opened.conversation
            await wait_until(lambda shown=shown: len(shown.views) == 2)  # type: ignore[misc]
            reply = opened.conversation.views[-1]
            assert header(reply).endswith("stopped at the token limit (F12 continues)")
            await quit_app(app)


async def test_the_cut_mark_stays_on_an_earlier_reply_after_the_next_turn_and_a_reopen(
    kvhome: Path,
) -> None:
    from tests.e2e.tui.test_tui_relaunch_and_continue import quit_app

    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Write a long poem about the sea.")
        first = main.conversation.views[-1]
        assert header(first).endswith("stopped at the token limit (F12 continues)")
        await send(pilot, main, "Thanks.")
        # Only the last reply can be continued; the earlier one still says it was cut.
        assert header(first).endswith("stopped at the token limit")
        assert "F12" not in header(first)
        await quit_app(app)

    again = make_app(max_tokens=4)
    async with again.run_test(size=SIZE):
        main = await ready(again)
        await wait_until(lambda: len(main.conversation.views) == 4)
        assert header(main.conversation.views[1]).endswith("stopped at the token limit")
        await quit_app(again)


# --- item 5: F1 help wraps, whatever the width --------------------------------------------------


def _screen_lines(app: object) -> list[str]:
    """The screen as text lines (from the app's screenshot)."""
    import html
    import re

    svg = app.export_screenshot()  # type: ignore[attr-defined]
    rows: dict[float, list[tuple[float, str]]] = {}
    for m in re.finditer(r'<text[^>]*x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', svg):
        rows.setdefault(float(m.group(2)), []).append((float(m.group(1)), m.group(3)))
    return ["".join(html.unescape(t) for _, t in sorted(rows[y])) for y in sorted(rows)]


def _body_text(view: MessageView) -> str:
    """The text of a message's rendered Markdown."""
    return view.body.shown_text


def _shown_text(widget: object) -> str:
    """The words a widget shows on screen (its rendered lines, joined)."""
    from textual.geometry import Region
    from textual.widget import Widget

    assert isinstance(widget, Widget)
    width, height = widget.content_region.size
    lines = widget.render_lines(Region(0, 0, width, height))
    return " ".join(" ".join(strip.text.split()) for strip in lines).strip()


@pytest.mark.parametrize("size", [(120, 36), (80, 24)])
async def test_f1_help_shows_every_description_whole(kvhome: Path, size: tuple[int, int]) -> None:
    from textual.widgets import Label

    from kvchat.tui.keys import KEYS
    from kvchat.tui.screens.help import HelpScreen

    app = make_app()
    async with app.run_test(size=size) as pilot:
        await ready(app)
        await pilot.press("f1")
        await wait_until(lambda: isinstance(app.screen, HelpScreen))
        await pilot.pause()
        actions = list(app.screen.query(".key-action").results(Label))
        assert len(actions) == len(KEYS)
        for label, key in zip(actions, KEYS):
            assert label.region.right <= size[0]
            assert _shown_text(label) == " ".join(key.description.split())
        newline = next(a for a, k in zip(actions, KEYS) if k.label == "Ctrl+J")
        assert newline.size.height >= 2  # wrapped, not cut


# --- item 6: the settings dialog says what a new system prompt costs ---------------------------


async def test_settings_say_a_new_system_prompt_rereads_the_conversation(kvhome: Path) -> None:
    from textual.widgets import Label, TextArea

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Name three colours of the rainbow.")
        held = main.status.used  # the context: what the session's KV holds
        assert held > 20
        await pilot.press("ctrl+g")
        await wait_until(lambda: app.screen.__class__.__name__ == "SettingsDialog")
        dialog = app.screen
        hint = str(dialog.query(".dialog-detail").results(Label).__next__().render())
        assert "[presets]" in hint and "config.toml" in hint  # not eaten as markup
        cost = dialog.query_one("#prompt-cost", Label)
        assert not cost.display  # nothing changed yet
        dialog.query_one("#system-prompt", TextArea).text = "Answer like a pirate."
        await pilot.pause()
        assert cost.display
        said = str(cost.render())
        assert f"about {held:,} tokens" in said and "re-read" in said
        await pilot.press("ctrl+s")
        await wait_until(lambda: app.screen is main)
        assert any(f"about {held:,} tokens" in n.message for n in app._notifications)
        await send(pilot, main, "And the warmest?")
        report = main.last_report
        assert report is not None
        # As said: the conversation was read again, not reused.
        assert report.tokens.reused < 10
        assert report.tokens.decoded >= held - 10


# --- item 7: a "New chat" that never got a message is dropped at quit --------------------------


async def test_new_chats_that_never_got_a_message_are_gone_after_quit(kvhome: Path) -> None:
    from kvchat.service.chat import ChatService
    from tests.conftest import run_cli_here
    from tests.e2e.tui.test_tui_relaunch_and_continue import make_settings, quit_app

    service = ChatService(make_settings())
    kept_empty = service.sessions.new_session()  # not made by the app's run: not its to drop
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await pilot.press("ctrl+n")
        await wait_until(lambda: main.session_id not in (None, kept_empty.id))
        await send(pilot, main, "Hello.")
        used = main.session_id
        await pilot.press("ctrl+n")
        await wait_until(lambda: main.session_id not in (None, kept_empty.id, used))
        await pilot.press("ctrl+n")
        await wait_until(lambda: len(main.made_sessions) == 3)
        await wait_until(lambda: len(main.sessions.rows) == 4)
        await quit_app(app)

    listed = run_cli_here(kvhome, "list", "--json").json
    assert sorted(s["id"] for s in listed) == sorted([used, kept_empty.id])
    again = make_app()
    async with again.run_test(size=SIZE):
        main = await ready(again)
        assert main.session_id == used  # the session last open was dropped: the one used
        await quit_app(again)


# --- item 10: the status bar's KV figures are the latest --------------------------------------


async def test_the_kv_status_follows_each_turn_after_a_restore(kvhome: Path) -> None:
    from tests.e2e.tui.test_tui_relaunch_and_continue import quit_app

    app = make_app(max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Name a colour.")
        await quit_app(app)

    again = make_app(max_tokens=16)
    async with again.run_test(size=SIZE) as pilot:
        main = await ready(again)
        assert main.status.memory_text.startswith("KV: restored ")  # how it came back
        for text in ("Name a fruit.", "Name a tree."):
            await send(pilot, main, text)
            report = main.last_report
            assert report is not None and report.snapshot.written > 0
            # Each turn's own figure: what it wrote, not the restore at opening.
            assert main.status.memory_text.startswith("KV: hot · wrote ")
            held = await again.engine_thread.run(lambda: again.service.context_tokens)  # type: ignore[union-attr]
            assert main.status.used == held
        before = main.last_turn
        await pilot.press("ctrl+r")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await wait_until(lambda: main.housekeeping_idle)
        await pilot.pause()
        held = await again.engine_thread.run(lambda: again.service.context_tokens)  # type: ignore[union-attr]
        assert main.status.used == held  # the gauge after a regenerate too
        await quit_app(again)


# --- item 14: the code-block picker --------------------------------------------------------------

THREE_BLOCKS = """Three ways:

```python
def rev(s):
    return s[::-1]
```

```python
def rev(s):
    return "".join(reversed(s))
```

```python
def rev(s):
    out = ""
    for ch in s:
        out = ch + out
    return out
```
"""


async def test_the_code_picker_numbers_blocks_as_shown_and_copies_the_one_picked(
    kvhome: Path,
) -> None:
    from textual.widgets import OptionList

    from kvchat.service.chat import ChatService
    from kvchat.tui.phrases import code_blocks
    from kvchat.tui.screens.dialogs import CodePickerDialog
    from tests.e2e.tui.test_tui_relaunch_and_continue import make_settings

    service = ChatService(make_settings())
    session = service.sessions.new_session("Reverse a string")
    service.sessions.add_message(session.id, "user", "How do I reverse a string?")
    service.sessions.add_message(session.id, "assistant", THREE_BLOCKS)
    service.close()
    blocks = code_blocks(THREE_BLOCKS)

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await wait_until(lambda: len(main.conversation.views) == 2)
        await pilot.press("f5")
        await wait_until(lambda: isinstance(app.screen, CodePickerDialog))
        picker = app.screen.query_one("#blocks", OptionList)
        shown = [str(picker.get_option_at_index(i).prompt) for i in range(picker.option_count)]
        assert [line.split(".")[0] for line in shown] == ["1", "2", "3"]
        assert len(set(shown)) == 3  # each preview tells its block from the others
        assert "return s[::-1]" in shown[0] and "reversed" in shown[1] and 'out = ""' in shown[2]
        picker.highlighted = 2  # "3."
        await pilot.press("enter")
        await wait_until(lambda: app.clipboard == blocks[2])


# --- item 16: a long paste folds ------------------------------------------------------------------


async def test_a_long_paste_shows_folded_and_enter_unfolds_it(kvhome: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        paste = "\n".join(f"row {n}:" for n in range(1, 101))
        main.prompt.focus()
        main.prompt.insert(paste)
        await pilot.press("enter")
        await wait_until(lambda: main.turn is None and main.last_turn is not None)
        await pilot.pause()
        mine = main.conversation.views[0]
        assert mine.text == paste  # stored and copied whole
        assert "80 more lines" in mine.drawn_lines[-1]
        assert mine.size.height < 30  # not the whole screen and more
        shown = _body_text(mine)
        assert "row 20:" in shown and "row 21:" not in shown
        mine.focus()
        await pilot.press("enter")
        await pilot.pause()
        shown = _body_text(mine)
        assert "row 21:" in shown and "row 100:" in shown
        assert mine.size.height > 100
        await pilot.press("enter")  # folds again
        await pilot.pause()
        assert "row 21:" not in _body_text(mine)
        # A short message of yours has no fold.
        await send(pilot, main, "Short one.")
        short = main.conversation.views[2]
        assert not short.fold_note and "Enter" not in short.drawn_lines[-1]


# --- item 15: small windows --------------------------------------------------------------------


async def test_a_narrow_window_hides_the_sidebar_and_ctrl_l_brings_it_back(kvhome: Path) -> None:
    from textual.widgets import Button

    app = make_app()
    async with app.run_test(size=(60, 20)) as pilot:
        main = await ready(app)
        await send(pilot, main, "Hello.")
        assert not main.sessions.display
        assert main.conversation.size.width >= 55  # the chat has the window
        footer = [line for line in _screen_lines(app) if "Stop" in line][-1]
        assert "palette" not in footer  # no key overlapping another
        # The last turn's figures wrap onto a second line instead of being cut.
        summary = main.status.turn_text
        assert len(summary) > 60 and "…" not in summary
        shown = " ".join(" ".join(_screen_lines(app)).split())
        assert " ".join(summary.split()[-3:]) in shown
        await pilot.press("ctrl+l")
        assert main.sessions.display and app.focused is main.sessions
        await pilot.press("ctrl+l")  # in the list: hide it again
        assert not main.sessions.display and app.focused is main.prompt
        await pilot.press("ctrl+l")
        await pilot.press("enter")  # open the highlighted session: the chat gets the room
        await wait_until(lambda: not main.sessions.display)

        # The settings dialog scrolls: its Save button can be reached and seen.
        await pilot.press("ctrl+g")
        await wait_until(lambda: app.screen.__class__.__name__ == "SettingsDialog")
        save = app.screen.query_one("#save", Button)
        save.focus()  # as Tab reaches it: the dialog scrolls it into sight
        await wait_until(lambda: 0 <= save.region.y and save.region.bottom <= 20, timeout=10)
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main)

        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert main.sessions.display  # wide enough: shown again
        assert "palette" in [line for line in _screen_lines(app) if "Stop" in line][-1]
        await pilot.resize_terminal(60, 20)  # narrowed while running: the same as at start
        await pilot.pause()
        assert not main.sessions.display
        assert "palette" not in [line for line in _screen_lines(app) if "Stop" in line][-1]


async def test_at_80_columns_and_wider_the_sidebar_stays(kvhome: Path) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        main = await ready(app)
        assert main.sessions.display
        main.prompt.focus()
        await pilot.press("ctrl+l")
        assert app.focused is main.sessions
        await pilot.press("ctrl+l")  # hidden on request, at any width
        assert not main.sessions.display
        await pilot.press("ctrl+l")
        assert main.sessions.display and app.focused is main.sessions


# --- item 13: a long prompt's read shows its progress -------------------------------------------

LONG_MESSAGE = "Summarise these notes.\n" + "\n".join(
    f"Note {n}: the meeting moved to room {n % 7} on day {n % 5}." for n in range(1, 45)
)


async def test_a_long_prompt_shows_tokens_read_and_time_left(kvhome: Path) -> None:
    import asyncio
    import re

    app = make_app(n_ctx=4096, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        main.prompt.focus()
        main.prompt.insert(LONG_MESSAGE)
        await pilot.press("enter")
        seen: list[str] = []
        while main.turn is not None or main.last_turn is None:
            text = main.status.turn_text
            if text.startswith("reading the prompt ·") and text not in seen:
                seen.append(text)
            await asyncio.sleep(0.01)
        report = main.last_report
        assert report is not None and report.tokens.decoded > 500
        read = [re.search(r"([\d,]+) / ([\d,]+) tokens", t) for t in seen]
        pairs = [(int(m[1].replace(",", "")), int(m[2].replace(",", ""))) for m in read if m]
        assert len(pairs) >= 2, seen  # it moved while the prompt was read
        assert all(total == report.tokens.decoded for _, total in pairs), (pairs, report)
        assert [done for done, _ in pairs] == sorted(done for done, _ in pairs)
        assert any(" s left" in t or " min left" in t for t in seen)


# --- item 8: branches are named by what they are ------------------------------------------------


async def test_a_fork_and_an_edit_read_differently_in_the_sidebar(kvhome: Path) -> None:
    from kvchat.tui.screens.dialogs import EditDialog
    from kvchat.tui.widgets.prompt import PromptInput
    from tests.e2e.tui.test_tui_branches import titles

    app = make_app(max_tokens=8, auto_title=False)  # the titles of the first line
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Let's plan a trip to Japan in the spring.")
        original = main.session_id
        main.conversation.views[1].focus()
        await pilot.pause()
        await pilot.press("ctrl+t")  # fork at the reply, #2
        await wait_until(lambda: main.session_id not in (None, original))
        main.open_session(original)  # type: ignore[arg-type]
        await wait_until(lambda: main.session_id == original and len(main.conversation.views) == 2)
        main.conversation.views[0].focus()
        await pilot.pause()
        await pilot.press("f4")  # edit #1
        await wait_until(lambda: isinstance(app.screen, EditDialog))
        area = app.screen.query_one("#edit-text", PromptInput)
        area.clear()
        area.insert("Let's plan a trip to Korea in the spring.")
        last = main.last_turn
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not last and main.turn is None, 90)
        main.run_job(REFRESH_SESSIONS, main.refresh_sessions)
        await wait_until(lambda: len(main.sessions.rows) == 3)
        shown = titles(main)
        assert shown[0].startswith("▾ Let's plan a trip")
        assert sorted(t.split(":")[0] for t in shown[1:]) == ["└ Edit of #1", "└ Fork at #2"]
