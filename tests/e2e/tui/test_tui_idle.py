"""Idle is idle: with nothing happening the app draws nothing, collects garbage
once per idle stretch, and its watch reads one row every two seconds; a key wakes it.

The real app and the real model.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvchat.service.chat import ChatService
from kvchat.tui import app as app_module
from kvchat.tui.app import KvchatApp
from kvchat.tui.main.watch import WATCH_S
from tests.conftest import REPO
from tests.e2e.tui.test_tui import SIZE, make_settings, ready, wait_until


async def test_an_idle_app_draws_nothing_and_reads_one_row_per_look(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_module, "BLINK_REST_S", 1.0)
    service = ChatService(make_settings())
    for i in range(30):
        session = service.sessions.new_session(f"Session {i}")
        service.sessions.add_message(session.id, "user", f"question {i}", token_count=3)
    service.sessions.remember_open(session.id)
    service.close()
    app = KvchatApp(make_settings(), cursor_blink=True)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await wait_until(lambda: len(main.sessions.rows) == 30 and main.feed.complete)
        await wait_until(lambda: app.collector.started)
        await pilot.press("a")  # a key: the cursor blinks, a collection follows the pause
        assert main.prompt.cursor_blink
        collections = app.collector.collections
        await wait_until(lambda: not main.prompt.cursor_blink, timeout=10)  # resting
        await wait_until(lambda: app.collector.collections > collections, timeout=10)
        await wait_until(lambda: not any(w.is_running for w in main.workers))
        await pilot.pause(0.3)

        paints: list[float] = []
        store_calls: list[str] = []
        repaint = main._compositor_refresh
        on_store = app.backend.on_store

        def painted() -> None:
            paints.append(asyncio.get_running_loop().time())
            repaint()

        def stored(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            store_calls.append(getattr(fn, "__name__", repr(fn)))
            return on_store(fn, *args, **kwargs)

        monkeypatch.setattr(main, "_compositor_refresh", painted)
        monkeypatch.setattr(app.backend, "on_store", stored)
        collections = app.collector.collections
        await asyncio.sleep(WATCH_S * 2 + 0.5)
        # Nothing drawn, no collection, and each look of the watch one row read.
        assert paints == []
        assert app.collector.collections == collections
        assert store_calls and set(store_calls) == {"change_stamp"}, store_calls
        assert len(store_calls) <= 3, store_calls

        await pilot.press("b")  # awake: it blinks again
        assert main.prompt.cursor_blink and main.prompt.text.endswith("ab")


def _home_of_five() -> str:
    """Five sessions of two messages each ("Session 0" oldest); the app had "Session 1"
    open at its last quit. Returns that session's id."""
    service = ChatService(make_settings())
    ids = []
    for i in range(5):
        session = service.sessions.new_session(f"Session {i}")
        service.sessions.add_message(session.id, "user", f"question {i}", token_count=3)
        service.sessions.add_message(session.id, "assistant", f"answer {i}", token_count=3)
        ids.append(session.id)
    service.sessions.remember_open(ids[1])
    service.close()
    return ids[1]


async def test_the_first_paint_shows_sessions_while_the_engine_is_still_loading(
    kvhome: Path,
) -> None:
    """The sidebar and the last-open session are drawn from the store before the service
    (llama.cpp) opens; when it does, nothing drawn is drawn again or doubled, and what the
    user typed meanwhile stays."""
    opened = _home_of_five()
    app = KvchatApp(make_settings(), cursor_blink=False)
    gate = threading.Event()
    # The engine thread is busy until the gate opens: the service cannot open before.
    held = app.engine_thread.run(gate.wait)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        try:
            await wait_until(lambda: main.status.turn_text.startswith("loading model"), 30)
            assert app.service is None and main.shown_id == opened
            titles = [row.summary.session.title for row in main.sessions.rows]
            assert titles == [f"Session {i}" for i in (4, 3, 2, 1, 0)]
            assert [v.text for v in main.conversation.views] == ["question 1", "answer 1"]
            shown = list(main.conversation.views)
            await pilot.press(*"hello")
        finally:
            gate.set()
        await held
        main = await ready(app)
        await wait_until(lambda: main.feed.complete and main.last_restore is not None)
        assert app.service is not None and app.backend.index is None
        titles = [row.summary.session.title for row in main.sessions.rows]
        assert titles == [f"Session {i}" for i in (4, 3, 2, 1, 0)]
        assert main.conversation.views == shown  # the same views: not shown again
        assert main.prompt.text == "hello"
        assert app.backend.worker_errors == []


async def test_the_session_list_is_drawn_before_the_open_session_is_built(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first paint draws the list's first page before the open session's messages are
    built (their Markdown takes longer than the list), and the list's other pages are read
    only once the open session is drawn (at 10,000 sessions, laying them out as they came
    delayed the first frame)."""
    from kvchat.tui.main import session_feed
    from kvchat.tui.widgets.conversation import Conversation

    monkeypatch.setattr(session_feed, "PAGE", 2)  # five sessions: a first page and more
    opened = _home_of_five()
    events: list[str] = []
    show = Conversation.show

    async def showing(self: Conversation, messages: list[Any], *args: Any, **kwargs: Any) -> None:
        if messages and "messages built" not in events:
            events.append("messages built")
        await show(self, messages, *args, **kwargs)

    monkeypatch.setattr(Conversation, "show", showing)
    app = KvchatApp(make_settings(), cursor_blink=False)
    display = app._display

    def displayed(screen: Any, renderable: Any) -> None:
        display(screen, renderable)
        if renderable is not None and "list drawn" not in events:
            text = "".join(s.text for s in app.console.render(renderable) if not s.control)
            if "Session 4" in text:
                events.append("list drawn")

    monkeypatch.setattr(app, "_display", displayed)
    on_store = app.backend.on_store

    def stored(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", "") == "list_sessions_page":
            events.append("more sessions read")
        return on_store(fn, *args, **kwargs)

    monkeypatch.setattr(app.backend, "on_store", stored)
    async with app.run_test(size=SIZE):
        main = app.main
        await wait_until(lambda: main.shown_id == opened and main.feed.complete, 30)
        assert events[:3] == ["list drawn", "messages built", "more sessions read"], events
        titles = [row.summary.session.title for row in main.sessions.rows]
        assert titles == [f"Session {i}" for i in (4, 3, 2, 1, 0)]
        assert [v.text for v in main.conversation.views] == ["question 1", "answer 1"]
        assert app.backend.worker_errors == []


def test_the_first_paint_reads_import_no_engine_no_numpy_no_settings(kvhome: Path) -> None:
    """What the app reads before the service opens comes through a store-only index: no
    llama.cpp, numpy or sqlite-utils, and no settings (pydantic: ~0.2-0.3 s to import), since
    the data directory is a path (kvchat.paths), not a setting."""
    opened = _home_of_five()
    code = (
        "import sys\n"
        "from kvchat.tui.backend import Backend\n"
        "backend = Backend()\n"
        "backend.open_index()\n"
        "reader = backend.reader\n"
        "last = reader.last_open_session()\n"
        "print(last.id, len(reader.list_sessions_page(200).sessions),"
        " [m.content for m in reader.message_window(last.id, 60).messages])\n"
        "backend.close_index()\n"
        "print(sorted(m for m in ('llama_cpp', 'numpy', 'sqlite_utils', 'pydantic',"
        " 'kvchat.config', 'kvchat.service.chat', 'kvchat.kvcache') if m in sys.modules))"
    )
    env = {**os.environ, "KVCHAT_HOME": str(kvhome)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{opened} 5 ['question 1', 'answer 1']", "[]"]
