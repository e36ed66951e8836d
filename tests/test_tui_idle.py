"""Idle is idle (issue 26): with nothing happening the app draws nothing, collects garbage
once per idle stretch, and its watch reads one row every two seconds; a key wakes it.

The real app and the real model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvchat.service.chat import ChatService
from kvchat.tui import app as app_module
from kvchat.tui.app import KvchatApp
from kvchat.tui.main.watch import WATCH_S
from tests.test_tui import SIZE, make_settings, ready, wait_until


async def test_an_idle_app_draws_nothing_and_reads_one_row_per_look(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_module, "BLINK_REST_S", 1.0)
    service = ChatService(make_settings())
    for i in range(30):
        session = service.new_session(f"Session {i}")
        service.add_message(session.id, "user", f"question {i}", token_count=3)
    service.remember_open(session.id)
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
