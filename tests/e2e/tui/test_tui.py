"""Pilot tests of the terminal app on the real app and the real model (SmolLM2-135M).

Conversations are a few dozen tokens so the whole file runs in about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Label, Markdown, RadioButton, TextArea

from kvchat.config import Settings
from kvchat.engine import Engine
from kvchat.service.chat import ChatService
from kvchat.tui.app import EXIT_FATAL, KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.screens.dialogs import ConfirmDialog, EditDialog, ExportDialog, TextDialog
from kvchat.tui.screens.error import ErrorScreen
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.search import SearchScreen
from kvchat.tui.widgets.conversation import SHOWN, MessageView
from kvchat.tui.widgets.prompt import PromptInput

SIZE = (100, 30)


@pytest.fixture
def home(kvhome: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """conftest's private KVCHAT_HOME, and a scratch working directory for exports."""
    monkeypatch.chdir(tmp_path)
    return kvhome


def make_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"temperature": 0, "max_tokens": 24, "n_ctx": 2048, "n_threads": 1}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


_apps: list[KvchatApp] = []


def make_app(**overrides: object) -> KvchatApp:
    app = KvchatApp(make_settings(**overrides), cursor_blink=False)
    _apps.append(app)
    return app


@pytest.fixture(autouse=True)
def no_background_failures() -> object:
    """Background work reports failures as notices; in a test any failure is a bug."""
    _apps.clear()
    yield
    for app in _apps:
        assert app.worker_errors == [], app.worker_errors


async def wait_until(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll for work the app runs in its threads and workers."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")
        await asyncio.sleep(0.05)


async def ready(app: KvchatApp) -> MainScreen:
    main = app.main
    await wait_until(lambda: main.ready)
    # The reopened session is made hot right after the model loads.
    await wait_until(lambda: main.session_id is None or main.last_restore is not None)
    return main


async def send(pilot: Pilot[None], main: MainScreen, text: str, timeout: float = 90) -> MessageView:
    """Type and send a message, wait for the reply and the housekeeping after it (the
    settle and the snapshot write: what a user who pauses gets); return the reply's view."""
    main.prompt.focus()
    main.prompt.insert(text)
    before = main.last_turn
    await pilot.press("enter")
    await wait_until(lambda: main.last_turn is not before and main.turn is None, timeout)
    await wait_until(lambda: main.housekeeping_idle, timeout)
    await pilot.pause()
    return main.conversation.views[-1]


async def quit_app(app: KvchatApp) -> None:
    """Ctrl+Q as a key event (Pilot.press would wait for a screen that is gone)."""
    app.simulate_key("ctrl+q")
    await wait_until(lambda: app._closed)


def service_of(app: KvchatApp) -> ChatService:
    assert app.service is not None
    return app.service


def open_id(main: MainScreen) -> str:
    assert main.session_id is not None
    return main.session_id


def texts(main: MainScreen) -> list[tuple[str, str]]:
    return [(v.role, v.text) for v in main.conversation.views]


async def test_send_stream_quit_and_resume_from_disk(home: Path) -> None:
    """Two turns, quit, relaunch in a new app: the session reopens restored from disk."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id is None  # first run: nothing to reopen
        reply = await send(pilot, main, "Hi! What is 2+2?")
        assert reply.role == "assistant" and reply.text.strip()
        assert main.last_turn is not None and main.last_turn.pieces > 0  # it streamed
        assert reply.message_id is not None and not reply.partial
        stored = service_of(app).sessions.messages(open_id(main))
        assert reply.body.source == reply.text == stored[-1].content  # streamed == committed
        assert main.status.turn_text.startswith("full prefill:")
        assert "decoded" in main.status.turn_text
        await send(pilot, main, "And 3+3?")
        assert main.status.turn_text.startswith("hot context, reused")
        first_session = main.session_id
        shown = texts(main)
        assert [r for r, _ in shown] == ["user", "assistant", "user", "assistant"]
        await quit_app(app)
    assert app.return_code == 0

    app2 = make_app()
    async with app2.run_test(size=SIZE) as pilot:
        main = await ready(app2)
        assert main.session_id == first_session
        assert texts(main) == shown
        assert main.last_restore is not None and main.last_restore.source == "disk"
        assert main.status.memory_text.startswith("KV: restored ")
        assert "from disk in" in main.status.memory_text
        restored = main.last_restore.tokens
        assert main.status.used == restored > 0
        await send(pilot, main, "And 4+4?")
        assert main.last_report is not None
        assert main.last_report.tokens.reused >= restored - 1
        assert main.status.turn_text.startswith("hot context, reused")
        # What this turn did to the KV (saved it), not the opening's restore any more.
        assert main.status.memory_text.startswith("KV: hot · ")
        assert len(main.conversation.views) == 6
        await quit_app(app2)


async def test_escape_cancels_and_keeps_the_partial_reply(home: Path) -> None:
    # A greedy reply that runs to max_tokens (~10 s here), so the keys below always land
    # while it streams, however busy the machine is.
    app = make_app(max_tokens=1500, temperature=0, n_ctx=4096)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        main.prompt.insert("Write the numbers from 1 to 500 separated by commas.")
        await pilot.press("enter")
        await wait_until(lambda: main.turn is not None and main.turn.pieces >= 3)
        # The UI keeps taking keys while the engine thread generates.
        await pilot.press("a", "b", "c")
        assert main.prompt.text == "abc" and main.turn is not None
        main.prompt.clear()
        await pilot.press("escape")
        await wait_until(lambda: main.turn is None and main.last_turn is not None)
        await pilot.pause()
        report = main.last_report
        assert report is not None and report.finish_reason == "cancelled"
        assert report.tokens.decoded > 0 and 3 <= report.tokens.generated < 1500
        view = main.conversation.views[-1]
        assert view.partial and view.has_class("-partial")
        assert "partial" in view.drawn_lines[0]
        assert "cancelled" in main.status.turn_text
        stored = service_of(app).sessions.messages(open_id(main))
        assert stored[-1].role == "assistant" and stored[-1].partial
        assert stored[-1].content == view.text
        # Regenerate replaces the partial reply with a complete one (greedy, short).
        service_of(app).sessions.configure(open_id(main), settings={"max_tokens": 12})
        before = main.last_turn
        await pilot.press("ctrl+r")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await pilot.pause()
        stored = service_of(app).sessions.messages(open_id(main))
        assert [m.role for m in stored] == ["user", "assistant"]
        assert main.conversation.views[-1].text == stored[-1].content
        assert main.last_report is not None and main.last_report.tokens.generated <= 12


async def test_sessions_new_switch_rename_delete(home: Path) -> None:
    app = make_app(max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Name a color.")
        first = main.session_id
        await pilot.press("ctrl+n")
        await wait_until(lambda: main.session_id not in (None, first))
        second = main.session_id
        assert main.conversation.views == []
        await send(pilot, main, "Name a fruit.")
        await wait_until(lambda: len(main.sessions.rows) == 2)
        assert {r.id: r.kv for r in main.sessions.rows}[second] == "hot"

        # Switch back: the first session is restored from its snapshot (the warm tier in
        # RAM when the service keeps one, else the file on disk), not re-read.
        await wait_until(lambda: main.housekeeping_idle)
        first_saved = service_of(app).host.tiers.snapshot(first)
        assert first_saved is not None
        main.open_session(first)  # what selecting it in the sidebar does
        await wait_until(
            lambda: (
                main.session_id == first
                and main.last_restore is not None
                and main.last_restore.source in ("ram", "disk")
            )
        )
        assert main.last_restore.tokens == first_saved.n_tokens
        assert main.status.memory_text.startswith("KV: restored")
        assert texts(main)[0] == ("user", "Name a color.")
        await wait_until(lambda: {r.id: r.kv for r in main.sessions.rows}.get(first) == "hot")
        assert {r.id: r.kv for r in main.sessions.rows}[second] in ("ram", "disk")

        # Rename (F2).
        await pilot.press("f2")
        await wait_until(lambda: isinstance(app.screen, TextDialog))
        app.screen.query_one(Input).value = ""
        await pilot.press(*"Colors")
        await pilot.press("enter")
        await wait_until(lambda: "Colors" in [r.summary.session.title for r in main.sessions.rows])
        assert first is not None and service_of(app).sessions.resolve(first).title == "Colors"

        # Delete (F8) asks first; "n" keeps it, "y" deletes it.
        await pilot.press("f8")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("n")
        await wait_until(lambda: app.screen is main)
        assert len(service_of(app).sessions.list_sessions()) == 2
        await pilot.press("f8")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await wait_until(lambda: len(main.sessions.rows) == 1 and main.session_id == second)
        assert [s.session.id for s in service_of(app).sessions.list_sessions()] == [second]
        await wait_until(lambda: texts(main) and texts(main)[0] == ("user", "Name a fruit."))


async def test_search_jumps_to_the_hit_and_export(home: Path, tmp_path: Path) -> None:
    # Two sessions written through the service (no model needed to store text).
    service = ChatService(make_settings())
    target = service.sessions.new_session("Travel")
    service.sessions.add_message(target.id, "user", "Where is the Eiffel tower?")
    reply = "The **Eiffel tower** is in Paris.\n\n```python\nprint('Paris')\n```"
    service.sessions.add_message(target.id, "assistant", reply)
    other = service.sessions.new_session("Other")
    service.sessions.add_message(other.id, "user", "Tell me about pancakes")
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == other.id  # the last session reopens
        await pilot.press("ctrl+f")
        await wait_until(lambda: isinstance(app.screen, SearchScreen))
        search = app.screen
        assert isinstance(search, SearchScreen)
        await pilot.press(*"eiffel")
        await wait_until(lambda: len(search.hits) == 2)
        await pilot.press("down", "down", "enter")  # the second hit: the reply
        await wait_until(lambda: main.session_id == target.id and len(main.conversation.views) == 2)
        await pilot.pause()
        focused = app.focused
        assert isinstance(focused, MessageView) and focused.role == "assistant"
        assert focused.has_class("-hit")
        area = main.conversation.region
        assert main.conversation.scroll_y >= 0  # not the anchor's negative offset
        assert area.y <= focused.region.y < area.bottom  # the hit is on screen

        # Copy that message (Ctrl+O) and its code block (F5: the focused message's only one).
        await pilot.press("ctrl+o")
        assert app.clipboard.startswith("The **Eiffel tower**")
        await pilot.press("f5")
        await wait_until(lambda: app.clipboard == "print('Paris')")
        # A letter typed on a message goes to the input.
        await pilot.press("o", "k")
        assert main.prompt.text == "ok" and app.focused is main.prompt
        main.prompt.clear()

        # A query with one hit: Enter in the search box jumps straight to it.
        await pilot.press("ctrl+f")
        await wait_until(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"pancakes", "enter")
        await wait_until(lambda: main.session_id == other.id and app.screen is main)
        await wait_until(lambda: isinstance(app.focused, MessageView))
        assert isinstance(app.focused, MessageView)
        assert app.focused.text == "Tell me about pancakes"
        main.open_session(target.id)
        await wait_until(lambda: main.session_id == target.id and len(main.conversation.views) == 2)

        # Export as JSON and HTML to a chosen path.
        for fmt_index, suffix in ((0, "md"), (1, "json"), (2, "html")):
            await pilot.press("ctrl+s")
            await wait_until(lambda: isinstance(app.screen, ExportDialog))
            dialog = app.screen
            list(dialog.query(RadioButton))[fmt_index].value = True
            await pilot.pause()
            path_input = dialog.query_one("#path", Input)
            assert path_input.value.endswith(f"travel.{suffix}")
            out = tmp_path / f"out.{suffix}"
            path_input.value = str(out)
            await pilot.click("#export")
            await wait_until(out.exists)
        assert (tmp_path / "out.md").read_text().startswith("# Travel")
        doc = json.loads((tmp_path / "out.json").read_text())
        assert doc["session"]["title"] == "Travel"
        assert doc["messages"][0]["content"] == "Where is the Eiffel tower?"
        assert "<title>Travel</title>" in (tmp_path / "out.html").read_text()


async def test_session_settings_help_and_palette(home: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await pilot.press("ctrl+g")
        await wait_until(lambda: app.screen.__class__.__name__ == "SettingsDialog")
        dialog = app.screen
        dialog.query_one("#system-prompt", TextArea).text = "Answer like a pirate."
        dialog.query_one("#set-temperature", Input).value = "0.2"
        dialog.query_one("#set-max_tokens", Input).value = "16"
        await pilot.press("ctrl+s")
        await wait_until(lambda: app.screen is main)
        assert main.session_id is not None
        await wait_until(lambda: service_of(app).sessions.resolve(open_id(main)).settings != {})
        session = service_of(app).sessions.resolve(open_id(main))
        assert session.system_prompt == "Answer like a pirate."
        assert session.settings == {"temperature": 0.2, "max_tokens": 16}

        await pilot.press("f1")
        await wait_until(lambda: isinstance(app.screen, HelpScreen))
        assert len(app.screen.query(".key-row")) >= 15
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main)

        await pilot.press("ctrl+p")
        await pilot.press(*"export the session")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ExportDialog))
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main)


async def test_first_paint_and_typing_before_the_model_is_ready(home: Path) -> None:
    """The window is up and takes typing while the model loads; Enter waits for it."""
    gate = threading.Event()

    class SlowLoad(ChatService):
        def load_engine(self) -> Engine:
            gate.wait(60)
            return super().load_engine()

    app = KvchatApp(make_settings(), SlowLoad(make_settings()), cursor_blink=False)
    _apps.append(app)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await wait_until(lambda: main.status.turn_text.startswith("loading model"))
        assert not main.ready and main.conversation.query("#welcome")
        await pilot.press(*"hello")
        await pilot.press("enter")
        assert main.prompt.text == "hello" and main.turn is None  # kept, not sent
        assert any("still loading" in n.message for n in app._notifications)
        gate.set()
        await wait_until(lambda: main.ready)
        assert main.status.turn_text.startswith("ready")
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not None and main.turn is None)
        assert [v.role for v in main.conversation.views] == ["user", "assistant"]


async def test_missing_model_shows_an_error_screen(home: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    app = make_app(model=str(missing))
    async with app.run_test(size=SIZE):
        await wait_until(lambda: isinstance(app.screen, ErrorScreen))
        await wait_until(lambda: app.screen.query("#error-detail"))
        screen = app.screen
        assert "model file not found" in str(screen.query_one("#error-detail").render())
        assert str(missing) in str(screen.query_one("#error-path").render())
        # Textual's Markdown takes its text when mounted (after the screen shows): wait for it.
        await wait_until(lambda: "--model" in screen.query_one("#error-fix", Markdown).source)
        app.simulate_key("q")
        await wait_until(lambda: app._closed)
    assert app.return_code == EXIT_FATAL  # a script sees that the app could not start


async def test_not_a_gguf_file_shows_an_error_screen(home: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    app = make_app(model=str(bogus))
    async with app.run_test(size=SIZE):
        await wait_until(lambda: isinstance(app.screen, ErrorScreen))
        await wait_until(lambda: app.screen.query("#error-detail"))
        assert "not a GGUF model file" in str(app.screen.query_one("#error-detail").render())


async def test_a_long_session_shows_its_latest_messages_and_jumps_to_old_hits(home: Path) -> None:
    service = ChatService(make_settings())
    session = service.sessions.new_session("Long")
    for i in range(70):
        service.sessions.add_message(session.id, "user" if i % 2 == 0 else "assistant", f"line {i}")
    service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        views = main.conversation.views
        assert len(views) == SHOWN and views[-1].text == "line 69"
        earlier = f"{70 - SHOWN} earlier messages"
        assert earlier in str(main.conversation.query_one("#earlier", Label).render())
        await pilot.press("ctrl+f")
        await wait_until(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*'"line 3"', "enter")  # one hit: message 3, not among the last shown
        await wait_until(lambda: isinstance(app.focused, MessageView))
        assert isinstance(app.focused, MessageView) and app.focused.text == "line 3"
        # A window around the hit (#4), not everything from it to the end.
        views = main.conversation.views
        assert len(views) == 12 and views[0].number == 2 and app.focused.number == 4
        assert main.conversation.later == 70 - 13


async def test_branch_from_a_reply_reuses_the_shared_kv(home: Path) -> None:
    """f on the first reply: a new session with the first two messages, opened with the
    prefix it shares with the original restored from the original's snapshot."""
    app = make_app(max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Name a color.")
        await send(pilot, main, "Name a fruit.")
        original = open_id(main)
        before = service_of(app).sessions.messages(original)
        assert len(before) == 4
        first_reply = main.conversation.views[1]
        assert first_reply.role == "assistant"
        first_reply.focus()
        await pilot.pause()
        await pilot.press("ctrl+t")
        await wait_until(lambda: main.session_id not in (None, original))
        branch = open_id(main)
        await wait_until(lambda: main.last_restore is not None and main.hot_id == branch)
        assert len(main.sessions.rows) == 2 and branch in {r.id for r in main.sessions.rows}
        stored = service_of(app).sessions.messages(branch)
        assert [(m.role, m.content) for m in stored] == [(m.role, m.content) for m in before[:2]]
        assert texts(main) == [(m.role, m.content) for m in before[:2]]
        # Not a full prefill: the shared prefix came from the original's snapshot.
        restore = main.last_restore
        assert restore is not None and restore.source in ("ram", "disk"), restore
        assert restore.donor == original and restore.tokens >= 32
        assert main.status.memory_text.startswith("KV: restored")
        assert "shared prefix" in main.status.memory_text
        assert main.status.used == restore.tokens
        assert service_of(app).sessions.messages(original) == before  # the original is kept
        # The next turn in the branch decodes only what follows the restored prefix.
        await send(pilot, main, "Name a tree.")
        report = main.last_report
        assert report is not None and report.session_id == branch
        assert report.tokens.reused >= restore.tokens - 1
        assert report.tokens.decoded < report.tokens.prompt - restore.tokens + 2


async def test_edit_a_past_message_as_a_new_branch(home: Path) -> None:
    """F4 on the first user message: a branch holding the edited message and a new streamed
    reply; the original conversation is unchanged. Replies cannot be edited."""
    app = make_app(max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Name a color.")
        await send(pilot, main, "Name another one.")
        original = open_id(main)
        before = service_of(app).sessions.messages(original)

        main.conversation.views[1].focus()  # a reply: not editable
        await pilot.pause()
        await pilot.press("f4")
        await wait_until(
            lambda: any("Only your own messages" in n.message for n in app._notifications)
        )
        assert app.screen is main

        main.conversation.views[0].focus()
        await pilot.pause()
        await pilot.press("f4")
        await wait_until(lambda: isinstance(app.screen, EditDialog))
        area = app.screen.query_one("#edit-text", PromptInput)
        assert area.text == "Name a color."
        area.clear()
        await pilot.press(*"Name a fruit.")
        last = main.last_turn
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not last and main.turn is None, 90)
        await pilot.pause()
        branch = open_id(main)
        assert branch != original
        stored = service_of(app).sessions.messages(branch)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[0].content == "Name a fruit."
        assert stored[1].content.strip() and not stored[1].partial
        assert main.last_turn is not None and main.last_turn.pieces > 0  # it streamed
        assert main.last_report is not None and main.last_report.session_id == branch
        assert texts(main) == [(m.role, m.content) for m in stored]
        assert main.status.turn_text and "error" not in main.status.turn_text
        await wait_until(lambda: len(main.sessions.rows) == 2)
        assert service_of(app).sessions.messages(original) == before  # the original is kept

        # F4 with nothing selected edits your last message; Esc leaves everything as is.
        main.prompt.focus()
        await pilot.press("f4")
        await wait_until(lambda: isinstance(app.screen, EditDialog))
        assert app.screen.query_one("#edit-text", PromptInput).text == "Name a fruit."
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main)
        assert len(service_of(app).sessions.list_sessions()) == 2
