"""A long history stays light: the sessions sidebar draws only the rows on screen,
groups them by date, filters titles as you type, and shows what another process changed
within the watch's two seconds, redrawing only the row that changed; a long session opens
on its last page and every message is reachable by scrolling up, PgUp and Home; the
search dialog searches once a word is typed, not once per letter; a message of a
megabyte opens folded to its first few thousand characters.

The real app and the real model; the sessions are stored without the model
(``ChatService.add_message``), once per module, and copied into each test's home.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Label

from kvchat.bench.ui import _Frames
from kvchat.service.chat import ChatService
from kvchat.store.connection import SqlBase
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.screens.search import SearchScreen
from kvchat.tui.widgets.conversation import (
    EARLIER_PAGE,
    HIT_WINDOW,
    MAX_VIEWS,
    SHOWN,
    MessageView,
)
from kvchat.tui.widgets.message_view import FOLD_CHARS
from kvchat.tui.widgets.sidebar import SessionList
from tests.e2e.tui.test_tui import SIZE, make_app, make_settings, ready, wait_until
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)
from tests.e2e.tui.test_tui_branches import sidebar_lines

MANY = 1000
FEW = 100


def build_home(home: Path, sessions: int) -> None:
    """``sessions`` sessions of one message each, "Session 0000" the oldest."""
    service = ChatService(make_settings(), home=home)
    try:
        for i in range(sessions):
            session = service.sessions.new_session(f"Session {i:04d}")
            service.sessions.add_message(session.id, "user", f"question {i}", token_count=3)
    finally:
        service.close()


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Ready-made data directories with FEW and MANY sessions (built once for the module)."""
    built = {}
    for count in (FEW, MANY):
        home = tmp_path_factory.mktemp(f"home{count}")
        build_home(home, count)
        built[count] = home
    return built


def use_home(source: Path, kvhome: Path) -> None:
    shutil.copytree(source, kvhome, dirs_exist_ok=True)


def on_screen(main: MainScreen, text: str) -> bool:
    return any(text in line for line in sidebar_lines(main))


async def test_a_thousand_sessions_draw_only_what_is_on_screen_and_all_are_reachable(
    homes: dict[int, Path], kvhome: Path
) -> None:
    use_home(homes[MANY], kvhome)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        sessions = main.sessions
        await wait_until(lambda: len(sessions.rows) == MANY)  # every page read
        # No widget per session: the whole screen holds far fewer widgets than sessions.
        widgets = len(list(main.query("*")))
        assert widgets < 100, widgets
        # Two lines a session and the date header: the list scrolls over all of them.
        assert sessions.line_count == 2 * MANY + 1
        assert on_screen(main, "Session 0999") and not on_screen(main, "Session 0000")

        # End in the list: the oldest session is drawn and highlighted; Enter opens it.
        await pilot.press("ctrl+l", "end")
        await wait_until(lambda: on_screen(main, "Session 0000"))
        index = sessions.index
        assert index is not None and sessions.rows[index].summary.session.title == "Session 0000"
        await pilot.press("enter")
        oldest = sessions.rows[index].id
        await wait_until(lambda: main.session_id == oldest and main.hot_id == oldest)
        assert [v.text for v in main.conversation.views] == ["question 0"]
        # PgUp and Home go back up.
        await pilot.press("ctrl+l", "pageup")
        assert (sessions.index or 0) < index
        await pilot.press("home")
        await wait_until(lambda: on_screen(main, "Session 0999"))


async def test_slash_filters_the_titles_as_you_type(homes: dict[int, Path], kvhome: Path) -> None:
    use_home(homes[FEW], kvhome)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        sessions = main.sessions
        await wait_until(lambda: len(sessions.rows) == FEW)
        await pilot.press("ctrl+l", "slash", "0", "0", "4")
        titles = [r.summary.session.title for r in sessions.rows]
        expected = [f"Session 004{d}" for d in range(9, -1, -1)] + ["Session 0004"]
        assert titles == expected, titles
        assert on_screen(main, "/ 004") and on_screen(main, "Session 0040")
        await pilot.press("2")
        assert [r.summary.session.title for r in sessions.rows] == ["Session 0042"]
        assert not on_screen(main, "Session 0041")
        await pilot.press("backspace")
        assert len(sessions.rows) == 11
        # Enter opens the match; the filter stays until Esc.
        await pilot.press("enter")
        await wait_until(lambda: main.session_id == sessions.rows[0].id)
        await pilot.press("ctrl+l", "escape")
        assert sessions.filter_text is None and len(sessions.rows) == FEW
        assert not on_screen(main, "/ ")


async def test_sessions_are_grouped_by_date(kvhome: Path) -> None:
    service = ChatService(make_settings())
    now = datetime.now(UTC)
    dates = {
        "Fresh": now,
        "From yesterday": now - timedelta(days=1),
        "Earlier this week": now - timedelta(days=4),
        "Long ago": datetime(2024, 3, 15, 12, tzinfo=UTC),
    }
    for title, when in dates.items():
        session = service.sessions.new_session(title)
        service.sessions.add_message(session.id, "user", "hi", token_count=1)
        with service.store.conn:
            service.store.conn.execute(
                "UPDATE sessions SET updated = ? WHERE id = ?", (when.isoformat(), session.id)
            )
    service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await wait_until(lambda: len(main.sessions.rows) == 4)
        await pilot.pause()
        lines = [line for line in sidebar_lines(main) if line and " tok · " not in line]
        # Near midnight "yesterday" (24 h ago) may still be today's date, and so on.
        expected = ["Today", "Fresh", "Yesterday", "From yesterday", "Previous 7 days"]
        if now.astimezone().hour >= 1:
            assert lines[:5] == expected, lines
        assert lines[-2:] == ["March 2024", "Long ago"], lines


async def test_a_session_made_elsewhere_appears_and_a_change_redraws_one_row(
    homes: dict[int, Path], kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_home(homes[FEW], kvhome)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        sessions = main.sessions
        await wait_until(lambda: len(sessions.rows) == FEW)
        await pilot.pause()
        redrawn: list[tuple[int, int]] = []
        original = SessionList.refresh_lines

        def record(list_: SessionList, y_start: int, line_count: int = 1) -> None:
            redrawn.append((y_start, line_count))
            original(list_, y_start, line_count)

        # Another process (here another service on the same data) renames the newest
        # session (a rename counts as an update: it stays on top).
        target = sessions.rows[0]
        other = ChatService(make_settings())
        try:
            monkeypatch.setattr(sessions, "refresh_lines", record.__get__(sessions))
            lines_before = sessions.line_count
            started = time.monotonic()
            other.sessions.rename(target.id, "Renamed elsewhere")
            await wait_until(lambda: on_screen(main, "Renamed elsewhere"), timeout=10)
            assert time.monotonic() - started < 4  # the watch looks every 2 s
            # Its two lines only (the same sessions in the same order: nothing else moved).
            assert sessions.line_count == lines_before
            assert set(redrawn) == {(1, 2)}, redrawn  # under the "Today" header

            # A new session from elsewhere shows up on top within the same two seconds.
            made = other.sessions.new_session("Made in the shell")
            other.sessions.add_message(made.id, "user", "hello", token_count=1)
            await wait_until(lambda: sessions.rows[0].id == made.id, timeout=10)
            assert on_screen(main, "Made in the shell")
            # Deleted elsewhere: gone from the list.
            other.sessions.delete(made.id)
            await wait_until(lambda: all(r.id != made.id for r in sessions.rows), timeout=10)
        finally:
            other.close()


async def first_paint(home: Path, kvhome: Path) -> tuple[float, int]:
    """Seconds from start until the sidebar draws the newest session, and the objects the
    process holds then (a proxy for memory that does not depend on the machine's load)."""
    shutil.rmtree(kvhome, ignore_errors=True)
    use_home(home, kvhome)
    app = KvchatApp(make_settings(), cursor_blink=False)
    started = time.perf_counter()
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        while not any("Session" in line for line in sidebar_lines(main)):
            await pilot.pause(0.01)
        painted = time.perf_counter() - started
        await ready(app)
        await wait_until(lambda: main.feed.complete)
        gc.collect()
        # The app freezes its start-up objects out of the collector: count those too.
        objects = len(gc.get_objects()) + gc.get_freeze_count()
        await pilot.press("ctrl+q")
    return painted, objects


async def test_first_paint_and_memory_hardly_grow_from_100_to_1000_sessions(
    homes: dict[int, Path], kvhome: Path
) -> None:
    few, many = [], []
    for _ in range(2):  # the best of two: the machine is shared
        few.append(await first_paint(homes[FEW], kvhome))
        many.append(await first_paint(homes[MANY], kvhome))
    paint_few, paint_many = min(p for p, _ in few), min(p for p, _ in many)
    objects_few, objects_many = min(o for _, o in few), min(o for _, o in many)
    print(
        f"first paint {paint_few * 1000:.0f} ms / {paint_many * 1000:.0f} ms, "
        f"objects {objects_few:,} / {objects_many:,} ({FEW} / {MANY} sessions)"
    )
    assert paint_many < 1.5 * paint_few + 0.1, (paint_few, paint_many)
    assert objects_many < 1.5 * objects_few, (objects_few, objects_many)


async def test_every_message_of_a_long_session_is_reachable_by_pgup_and_home(kvhome: Path) -> None:
    service = ChatService(make_settings())
    session = service.sessions.new_session("Long")
    for i in range(500):
        role = "user" if i % 2 == 0 else "assistant"
        service.sessions.add_message(session.id, role, f"message {i}", token_count=2)
    service.sessions.remember_open(session.id)
    service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        conversation = main.conversation
        await wait_until(lambda: not conversation.pending)  # the first page, all mounted
        views = conversation.views
        earlier = 500 - SHOWN
        assert len(views) == SHOWN and views[-1].number == 500 and conversation.first == earlier
        assert f"{earlier} earlier messages" in str(
            conversation.query_one("#earlier", Label).content
        )

        # PgUp on the messages: at the top of the window the page before comes in, and the
        # message that was on top stays on screen (the place is kept).
        views[-1].focus()
        await pilot.pause()
        top = views[0]
        for _ in range(60):
            await pilot.press("pageup")
            if conversation.first < earlier:
                break
        await wait_until(lambda: conversation.first == earlier - EARLIER_PAGE)
        await pilot.pause()
        assert conversation.views[0].number == earlier + 1 - EARLIER_PAGE
        assert conversation.region.overlaps(top.region), (conversation.region, top.region)

        # Home: message #1, focused, drawn before the rest of its page is built; End: the
        # latest again. Never more than MAX_VIEWS.
        mounted: list[int] = []

        def on_first() -> bool:
            focused = app.focused
            if isinstance(focused, MessageView) and focused.number == 1:
                mounted.append(len(conversation.views))
                return True
            return False

        # Checked at each frame drawn (a poll could miss the moment: the rest of the page
        # follows within a few tens of milliseconds).
        first_drawn = _Frames(app).when(on_first)
        app.simulate_key("home")
        await asyncio.wait_for(first_drawn, 30)
        assert mounted[0] < SHOWN, mounted
        await wait_until(lambda: not conversation.pending and len(conversation.views) == SHOWN)
        assert isinstance(app.focused, MessageView) and app.focused.text == "message 0"
        assert conversation.first == 0 and len(conversation.views) <= MAX_VIEWS
        await pilot.press("end")
        await wait_until(lambda: conversation.later == 0 and conversation.views[-1].number == 500)


LONG = 5000


def build_long_session(home: Path) -> str:
    """A session of LONG messages stored at once through the import path (no model): the
    first says "zebra", the others "message N"."""
    service = ChatService(make_settings(), home=home)
    try:
        messages = [
            ("user" if i % 2 == 0 else "assistant", f"message {i}", None, 2, False)
            for i in range(1, LONG)
        ]
        item = {"title": "Five thousand", "messages": [("user", "the zebra", None, 2, False)]}
        item["messages"] += messages  # type: ignore[operator]
        [(session_id, _)] = service.store.import_sessions([item], "test:long")
        service.sessions.remember_open(session_id)
        return session_id
    finally:
        service.close()


async def test_a_long_session_opens_reading_a_page_and_a_search_jump_reads_its_window(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a 5,000-message session reads the page it shows (and the count, the last
    reply's version), not the session; a search jump to #1 reads the window around it."""
    build_long_session(kvhome)
    read: list[int] = []  # message rows the store thread's reads returned, but the search's
    rows = SqlBase._rows

    def counting(self: SqlBase, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        found = rows(self, sql, params)
        searching = "messages_fts" in sql  # the search dialog's hits
        if threading.current_thread().name.startswith("kvchat-store") and not searching:
            read.append(sum(1 for row in found if "content" in row and "role" in row))
        return found

    monkeypatch.setattr(SqlBase, "_rows", counting)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        conversation = main.conversation
        await wait_until(lambda: not conversation.pending)
        views = conversation.views
        assert views[-1].number == LONG and views[-1].text == f"message {LONG - 1}"
        assert len(views) == SHOWN and conversation.first == LONG - SHOWN
        assert sum(read) == SHOWN, read  # the last page, once

        # A search jump to #1: the hit and the window after it.
        await pilot.press("ctrl+f")
        await wait_until(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"zebra")
        await wait_until(lambda: len(getattr(app.screen, "hits", ())) == 1)
        read.clear()
        await pilot.press("enter")
        await wait_until(
            lambda: isinstance(app.focused, MessageView) and app.focused.text == "the zebra"
        )
        assert app.focused.number == 1  # type: ignore[union-attr]
        assert sum(read) == HIT_WINDOW, read
        assert conversation.later == LONG - HIT_WINDOW and len(conversation.views) == HIT_WINDOW


async def test_the_search_dialog_searches_once_a_word_is_typed(
    homes: dict[int, Path], kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_home(homes[FEW], kvhome)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        searched: list[str] = []
        on_store = app.backend.on_store

        def counting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if getattr(fn, "__name__", "") == "search":
                searched.append(args[0])
            return on_store(fn, *args, **kwargs)

        monkeypatch.setattr(app.backend, "on_store", counting)
        await pilot.press("ctrl+f")
        await wait_until(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"question")  # typed at once: one query, not one per letter
        await wait_until(lambda: len(getattr(app.screen, "hits", ())) > 0)
        assert searched[-1] == "question" and len(searched) <= 2, searched


async def test_a_message_of_a_megabyte_opens_folded_and_unfolds_on_enter(kvhome: Path) -> None:
    service = ChatService(make_settings())
    session = service.sessions.new_session("Big answer")
    log = "".join(f"line {i:06d} of a long log that was pasted whole\n" for i in range(21_000))
    assert len(log) > 1_000_000
    service.sessions.add_message(session.id, "user", "Show me the log.", token_count=5)
    service.sessions.add_message(session.id, "assistant", log, token_count=5)  # an imported reply
    service.sessions.remember_open(session.id)
    service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        asked, big = main.conversation.views
        assert big.folded and asked.text == "Show me the log."
        # The first few thousand characters are built, not the megabyte.
        assert len(big.body.source) <= FOLD_CHARS
        note = big.drawn_lines[-1]
        assert f"{len(big.text) - FOLD_CHARS:,} more characters" in note, note
        # Keys still answer at once: typing reaches the input.
        main.prompt.focus()
        await pilot.press("o", "k")
        assert main.prompt.text == "ok"
        big.focus()
        await pilot.press("enter")
        await wait_until(lambda: not big.folded and "line 020999" in big.body.source, 120)
