"""The real app and the real model: relaunch reopens the session the user was in, a switch
restores before Enter, Continue after a reply cut at the token limit, the app's watch on
another kvchat writing the open session, reply versions with left and right, and
housekeeping after a reply (the settle, the snapshot write) yielding to a new message;
quitting straight after a reply saves the valid prefix; the app imports nothing heavy.

Asserted by counts (tokens reused and decoded, messages shown), never by timings."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from textual.pilot import Pilot

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.phrases import snapshot_phrase
from kvchat.tui.widgets.conversation import MessageView
from tests.conftest import FAST, REPO, clean_env
from tests.e2e.tui.test_tui import SIZE, ready, send, wait_until
from tests.e2e.tui.test_tui import make_app as tui_app
from tests.e2e.tui.test_tui import make_settings as tui_settings
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)

# Shorter replies and context than test_tui's apps: these tests count tokens, not text.
ITEM_SETTINGS: dict[str, object] = {"max_tokens": 16, "n_ctx": 1024}


def make_settings(**overrides: object) -> Settings:
    return tui_settings(**{**ITEM_SETTINGS, **overrides})


def make_app(**overrides: object) -> KvchatApp:
    return tui_app(**{**ITEM_SETTINGS, **overrides})


async def pick_in_sidebar(pilot: Pilot[None], main: MainScreen, session_id: str) -> None:
    """Ctrl+L, move to the session, Enter: as a user opens one."""
    await pilot.press("ctrl+l")
    await wait_until(lambda: any(r.id == session_id for r in main.sessions.rows))
    main.sessions.index = next(i for i, r in enumerate(main.sessions.rows) if r.id == session_id)
    await pilot.press("enter")


async def quit_app(app: KvchatApp) -> None:
    app.simulate_key("ctrl+q")
    await wait_until(lambda: app._closed)


def texts(main: MainScreen) -> list[str]:
    return [v.text for v in main.conversation.views]


def header(view: MessageView) -> str:
    """The role line the message draws (its first line)."""
    return view.drawn_lines[0].strip()


# --- issue 11.2: relaunch opens the session the user was in -----------------------------------


async def test_relaunch_reopens_the_session_open_at_quit(kvhome: Path) -> None:
    service = ChatService(make_settings())
    older = service.sessions.new_session("Older")
    service.sessions.add_message(older.id, "user", "older question")
    newer = service.sessions.new_session("Newer")  # the last made: what a first launch opens
    service.sessions.add_message(newer.id, "user", "newer question")
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == newer.id
        await pick_in_sidebar(pilot, main, older.id)
        await wait_until(lambda: main.session_id == older.id and main.hot_id == older.id)
        await quit_app(app)

    again = make_app()
    async with again.run_test(size=SIZE):
        main = await ready(again)
        assert main.session_id == older.id
        await wait_until(lambda: texts(main) == ["older question"])
        await quit_app(again)


# --- issue 14.5: resume before Enter ---------------------------------------------------------


async def test_a_switch_restores_before_enter_so_the_first_turn_reads_only_itself(
    kvhome: Path,
) -> None:
    service = ChatService(make_settings())
    a = service.sessions.new_session("A")
    service.send(a.id, "Name a color.")
    b = service.sessions.new_session("B")
    service.send(b.id, "Name a fruit.")
    a_history = service.host.tiers.snapshot(a.id)
    assert a_history is not None and a_history.n_tokens > 0
    service.close()  # saves b, the hot session
    b_history = ChatService(make_settings()).host.tiers.snapshot(b.id)
    assert b_history is not None

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        # The session reopened at launch came back before any key: from disk.
        assert main.session_id == b.id and main.hot_id == b.id
        assert main.last_restore is not None and main.last_restore.source == "disk"
        assert main.last_restore.tokens == b_history.n_tokens
        assert "the next message reads only itself" in main.status.turn_text

        await pick_in_sidebar(pilot, main, a.id)
        await wait_until(lambda: main.hot_id == a.id)  # restored with no message sent
        restore = main.last_restore
        assert restore is not None and restore.source in ("ram", "disk")
        assert restore.tokens == a_history.n_tokens
        assert main.status.turn_text.startswith("KV ready: restored")
        assert main.status.memory_text.startswith("KV: restored")

        await send(pilot, main, "And another?")
        report = main.last_report
        assert report is not None
        # The turn found the session hot: it reused the whole restored history and
        # decoded only the new message (its template markup included).
        assert report.restore.source == "hot"
        assert report.tokens.reused >= restore.tokens - 1
        assert report.tokens.decoded == report.tokens.prompt - report.tokens.reused
        assert report.tokens.decoded < 20 < restore.tokens
        assert main.status.turn_text.startswith("hot context, reused")
        await quit_app(app)


# --- issue 11.4: a reply cut at the token limit, and Continue --------------------------------


async def test_a_reply_cut_at_the_token_limit_offers_continue(kvhome: Path) -> None:
    app = make_app(max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        reply = await send(pilot, main, "Write a long story about a lighthouse keeper.")
        report = main.last_report
        assert report is not None and report.finish_reason == "length"
        assert "stopped at the token limit" in main.status.turn_text
        assert "F12 continues" in main.status.turn_text
        assert "stopped at the token limit (F12 continues)" in header(reply)
        first_part = reply.text
        session_id = main.session_id
        assert session_id is not None

        before = main.last_turn
        await pilot.press("f12")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await pilot.pause()
        more = main.last_report
        assert more is not None and more.tokens.generated > 0
        # From the hot KV: the cut reply was already in the context, nothing re-read.
        assert more.restore.source == "hot"
        assert more.tokens.decoded <= 2 and more.tokens.reused > 0
        # One reply, longer, shown and stored alike.
        views = main.conversation.views
        assert [v.role for v in views] == ["user", "assistant"] and views[-1] is reply
        assert reply.text.startswith(first_part) and len(reply.text) > len(first_part)
        stored = app.service.sessions.messages(session_id)  # type: ignore[union-attr]
        assert len(stored) == 2 and stored[-1].content == reply.text
        await quit_app(app)


# --- issue 11.5: another kvchat writing to the open session ------------------------------------


def _ask(home: Path, session_id: str, text: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["KVCHAT_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "--session", session_id, text, *FAST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_another_process_writing_the_open_session_shows_and_its_lock_is_kept(
    kvhome: Path,
) -> None:
    service = ChatService(make_settings())
    session = service.sessions.new_session("Shared")
    service.sessions.add_message(session.id, "user", "first question")
    service.sessions.add_message(session.id, "assistant", "first answer")
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == session.id and len(main.conversation.views) == 2

        # Another process runs a turn on the open session: its two messages show up.
        proc = await asyncio.to_thread(_ask, kvhome, session.id, "Question from a shell")
        assert proc.returncode == 0, proc.stderr
        stored = [m.content for m in app.service.sessions.messages(session.id)]  # type: ignore[union-attr]
        assert len(stored) == 4 and stored[2] == "Question from a shell"
        # (A reply saved as it streams may show first, then its final text.)
        await wait_until(lambda: texts(main) == stored, timeout=30)
        # "2 new messages from another kvchat", or "… updated by another kvchat" when the
        # reply showed as it streamed and then its final text (the status line is set just
        # after the messages are drawn: waited for, not read in between).
        await wait_until(lambda: main.status.turn_text.endswith("another kvchat"), timeout=10)
        assert texts(main) == stored

        # While another process holds the session's turn lock, Enter says so and keeps
        # the message; nothing is stored or shown.
        locks = app.service.locks  # type: ignore[union-attr]
        with locks.hold(session.id):
            main.prompt.focus()
            main.prompt.insert("mine")
            await pilot.press("enter")
            await wait_until(lambda: "another kvchat is replying" in main.status.turn_text)
            assert main.prompt.text == "mine" and main.turn is None
            assert len(main.conversation.views) == 4
            assert any("is busy" in n.message for n in app._notifications)
        assert len(app.service.sessions.messages(session.id)) == 4  # type: ignore[union-attr]

        # Free again: the same Enter sends it.
        before = main.last_turn
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        assert texts(main)[4] == "mine" and len(main.conversation.views) == 6
        await quit_app(app)


# --- issue 11.10: reply versions, ←/→ on the last reply ----------------------------------------


async def test_left_and_right_on_the_last_reply_switch_its_versions(kvhome: Path) -> None:
    app = make_app(max_tokens=8, temperature=1.0)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        first = await send(pilot, main, "Name a color.")
        first_text, reply_id = first.text, first.message_id
        assert reply_id is not None and "reply 1/" not in header(first)
        before = main.last_turn
        await pilot.press("ctrl+r")  # a second version; the first is kept
        await wait_until(lambda: main.last_turn is not before and main.turn is None)
        await pilot.pause()
        reply = main.conversation.views[-1]
        second_text = reply.text
        assert reply.message_id == reply_id and "reply 2/2" in header(reply)
        service = app.service
        assert service is not None and main.session_id is not None
        session_id = main.session_id

        def stored() -> list[str]:
            return [m.content for m in service.sessions.messages(session_id)]

        reply.focus()
        await pilot.press("left")
        await wait_until(lambda: reply.version == (1, 2))
        assert "reply 1/2" in header(reply) and reply.text == first_text
        # The store's conversation reads as shown: the first version is current.
        assert stored() == [v.text for v in main.conversation.views] and len(stored()) == 2
        assert stored()[-1] == first_text

        await pilot.press("left")  # no earlier version: it says so and stays
        await wait_until(lambda: any("first version" in n.message for n in app._notifications))
        assert reply.version == (1, 2)
        await pilot.press("right")
        await wait_until(lambda: reply.version == (2, 2))
        assert reply.text == second_text and stored()[-1] == second_text
        await quit_app(app)


# --- issue 14.4: never make the user wait for housekeeping ------------------------------------

FIRST = "Name three colours of the rainbow."
SECOND = "Which of them is the warmest?"
THIRD = "And the coldest?"


async def send_at_once(main: MainScreen, text: str, timeout: float = 90) -> None:
    """Send ``text`` the moment the reply ends, before the app could start its housekeeping
    (as Enter does: ``submit`` with the input's text)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while main.turn is not None:  # every step of the UI's loop: not a 50 ms poll
        assert asyncio.get_running_loop().time() < deadline, "the reply did not end"
        await asyncio.sleep(0)
    before = main.last_turn
    main.turns.start(main.turns.submit(text))
    assert main.turn is not None  # it started
    await wait_until(lambda: main.last_turn is not before and main.turn is None, timeout)


async def test_a_message_sent_straight_after_a_reply_does_not_wait_for_housekeeping(
    kvhome: Path,
) -> None:
    app = make_app(max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, FIRST)
        # As Enter does (a key press would wait for the reply's end).
        main.turns.start(main.turns.submit(SECOND))
        assert main.turn is not None
        await send_at_once(main, THIRD)
        second = main.turn_figures[main.conversation.views[-3].message_id or 0]
        third = main.last_report
        assert third is not None and third is not second
        assert third.restore.source == "hot"
        # The settle of the second reply was dropped (and its snapshot write with it): the
        # context kept the prompt before that reply, so this turn re-read the reply and the
        # new message, as a full prefill would.
        assert second.snapshot.bytes == 0
        assert third.tokens.reused == second.tokens.prompt
        assert third.tokens.decoded == third.tokens.prompt - third.tokens.reused
        assert third.tokens.decoded >= second.tokens.generated
        # Its own housekeeping runs once the app is idle: the status says what it wrote.
        await wait_until(lambda: main.housekeeping_idle)
        await pilot.pause()
        assert third.snapshot.bytes > 0  # the turn's figures got the write
        assert main.status.memory_text == f"KV: hot · {snapshot_phrase(third.snapshot)}"
        session_id = main.session_id
        assert session_id is not None
        await quit_app(app)
    assert app.worker_errors == []

    # The greedy reply is a full prefill's: the same history read from nothing.
    service = ChatService(make_settings(max_tokens=24))
    try:
        baseline = service.regenerate(session_id, no_restore=True)
    finally:
        service.close()
    assert baseline.tokens.reused == 0
    assert baseline.reply == third.reply


async def test_after_a_pause_the_settle_ran_and_the_next_turn_reads_only_the_message(
    kvhome: Path,
) -> None:
    app = make_app(max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        main.prompt.focus()
        main.prompt.insert(FIRST)
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not None and main.turn is None)
        first = main.last_report
        assert first is not None
        # The turn returned before its housekeeping; the idle app runs it.
        await wait_until(lambda: main.housekeeping_idle)
        await pilot.pause()
        assert first.snapshot.bytes > 0 and first.snapshot.written > 0
        assert main.status.memory_text.startswith("KV: hot · wrote ")
        assert "to disk in" in main.status.memory_text
        settled = main.status.used  # the gauge: the context after the settle

        await send(pilot, main, SECOND)
        second = main.last_report
        assert second is not None and second.restore.source == "hot"
        assert second.tokens.reused == settled
        # The context held the next prompt up to the user's words: only they are decoded.
        assert second.tokens.reused > first.tokens.prompt + first.tokens.generated
        assert second.tokens.decoded == second.tokens.prompt - second.tokens.reused
        assert second.tokens.decoded < 24
        await quit_app(app)
    assert app.worker_errors == []


async def test_quitting_straight_after_a_reply_saves_the_valid_prefix(kvhome: Path) -> None:
    app = make_app(max_tokens=24)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        # As Enter does (a key press would wait for the reply's end).
        main.turns.start(main.turns.submit(FIRST))
        assert main.turn is not None
        while main.turn is not None:
            await asyncio.sleep(0)
        service = app.service
        assert service is not None and service.upkeep.pending
        session_id = main.session_id
        report = main.last_report
        assert report is not None
        app.simulate_key("ctrl+q")  # straight after the reply
        await wait_until(lambda: app._closed)
    assert app.worker_errors == []
    # Closing saved the valid prefix: the next launch restores it and reads the rest.
    again = make_app(max_tokens=24)
    async with again.run_test(size=SIZE) as pilot:
        main = await ready(again)
        assert main.session_id == session_id
        assert main.last_restore is not None and main.last_restore.source == "disk"
        # The valid prefix: the prompt (the reply as generated is not a prefill's KV).
        assert main.last_restore.tokens == report.tokens.prompt
        await send(pilot, main, SECOND)
        assert main.conversation.views[-1].text.strip()
        await quit_app(again)


# --- issue 14.3: the first frame needs nothing heavy; the UI bench's bounds ----------------------

HEAVY = (
    "pydantic",
    "llama_cpp",
    "kvchat.config",
    "kvchat.service.chat",
    "kvchat.planner",
    "markdown_it",
    "rich.markdown",
    "pygments",
)


def test_nothing_heavy_is_imported_with_the_app() -> None:
    """The first frame is drawn before the settings (pydantic), the service (llama.cpp),
    the catalog, the Markdown parser and Rich's Markdown (with Pygments) are imported: the
    app module needs none of them."""
    code = (
        "import sys, kvchat.tui.app, kvchat.bench.ui\n"
        f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
