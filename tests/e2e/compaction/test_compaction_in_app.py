"""Compaction in the app, through Pilot on the real model (issue 42): the divider where the
model's window starts (on opening and after each turn), the gauge with the reply reserve, the
compaction offered when the next turn would leave messages out (overflow = "compact") or
only a warning (overflow = "drop"), /compact, and Esc while the summary is written."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Label

from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from kvchat.text import visible
from kvchat.tui.main import MainScreen
from kvchat.tui.screens.compaction import CompactionDialog
from tests.e2e.tui.test_tui import SIZE, home, make_app, ready, send, service_of, wait_until

__all__ = ["home"]  # the fixture (tests/e2e/tui/test_tui.py)

N_CTX = 512
MAX_TOKENS = 16
TOPICS = ["the Moon", "the ocean", "volcanoes", "glaciers", "comets", "deserts", "rivers"]


def long_session(exchanges: int = 16) -> str:
    """A session longer than the context, stored as text (the app reopens it)."""
    service = ChatService(load_settings(n_ctx=N_CTX, max_tokens=MAX_TOKENS))
    try:
        session = service.sessions.new_session()
        for i in range(exchanges):
            topic = TOPICS[i % len(TOPICS)]
            service.sessions.add_message(
                session.id,
                "user",
                f"Turn {i}: tell me one fact about {topic}, in a short sentence, and how "
                "old it is, roughly, please.",
            )
            service.sessions.add_message(
                session.id,
                "assistant",
                f"Fact {i}: {topic} is older than most people think, and it changes so "
                "slowly that nobody alive will see it.",
            )
        return session.id
    finally:
        service.close()


def divider(main: MainScreen) -> str | None:
    found = list(main.conversation.query("#window-divider").results(Label))
    return str(found[0].content) if found else None


def divider_above(main: MainScreen) -> int | None:
    """The message id of the view right below the divider."""
    page = main.conversation.page
    if page is None:
        return None
    children = list(page.children)
    for index, child in enumerate(children):
        if child.id == "window-divider":
            below = [c for c in children[index + 1 :] if c.id != "window-summary"]
            return getattr(below[0], "message_id", None) if below else None
    return None


def summary_shown(main: MainScreen) -> str | None:
    found = list(main.conversation.query("#window-summary").results(Label))
    return str(found[0].content) if found else None


async def test_drop_shows_the_divider_the_gauge_and_a_warning(home: Path) -> None:
    session_id = long_session()
    app = make_app(n_ctx=N_CTX, max_tokens=MAX_TOKENS, overflow="drop")
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == session_id
        await wait_until(lambda: divider(main) is not None)  # on opening, before any turn
        assert "earlier messages are kept but not read" in (divider(main) or "")
        assert summary_shown(main) is None  # no compaction: no summary
        await send(pilot, main, "Turn 16: and one about the Moon?")
        report = main.last_report
        assert report is not None and report.view is not None and report.dropped_messages
        view = report.view
        await wait_until(lambda: divider(main) == f"── {view.divider()} ──")
        assert divider_above(main) == view.first_message_id
        gauge = str(main.status.query_one("#status-ctx", Label).content)
        # What the context holds (the settle after the reply moves it on), the reply reserve.
        assert f"{main.status.used:,}/{N_CTX:,} +{MAX_TOKENS} reply" in gauge
        assert gauge.endswith(" !") == view.next_drops
        assert not isinstance(app.screen, CompactionDialog)  # drop: no offer
        assert service_of(app).store.current_summary(session_id) is None


async def test_compact_is_offered_kept_and_the_next_turn_reads_only_itself(home: Path) -> None:
    session_id = long_session()
    app = make_app(n_ctx=N_CTX, max_tokens=MAX_TOKENS)  # overflow = "compact", the default
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        await send(pilot, main, "Turn 16: and one about the Moon?")
        view = main.last_report.view if main.last_report else None
        assert view is not None and view.next_drops
        await wait_until(lambda: isinstance(app.screen, CompactionDialog))
        dialog = app.screen
        assert isinstance(dialog, CompactionDialog)
        assert "a summary replaces" in str(dialog.query_one("#compaction-cost", Label).content)
        await wait_until(lambda: not dialog.writing, timeout=120)
        written = dialog.text.strip()
        assert written
        await pilot.press("ctrl+s")
        service = service_of(app)
        await wait_until(lambda: service.store.current_summary(session_id) is not None, 120)
        await wait_until(lambda: "with a summary of" in (divider(main) or ""))
        summary = service.store.current_summary(session_id)
        assert summary is not None and summary.text == written
        assert summary_shown(main) == f"Summary the model reads: {visible(written)}"
        assert divider_above(main) is not None
        assert divider_above(main) == min(
            m.id for m in service.store.messages(session_id) if m.id > summary.upto_message_id
        )
        await wait_until(lambda: main.status.turn_text.startswith("compacted:"))
        text = "Turn 17: and one about comets?"
        await send(pilot, main, text)
        report = main.last_report
        assert report is not None and report.view is not None
        assert report.restore.source == "hot" and report.tokens.reused > 0
        own = service.host.token_engine().count_tokens(text)
        assert own <= report.tokens.decoded <= own + 8
        assert report.view.summarized and not report.view.next_drops


async def test_esc_while_the_summary_is_written_stores_nothing(home: Path) -> None:
    session_id = long_session()
    app = make_app(n_ctx=N_CTX, max_tokens=MAX_TOKENS, overflow="drop")
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        before = [m.id for m in service_of(app).store.messages(session_id)]
        main.prompt.focus()
        main.prompt.insert("/compact")
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, CompactionDialog))
        dialog = app.screen
        assert isinstance(dialog, CompactionDialog) and dialog.writing
        await pilot.press("escape")
        await wait_until(lambda: "not compacted" in main.status.turn_text, 60)
        await wait_until(lambda: main.housekeeping_idle and main.turn is None)
        service = service_of(app)
        assert service.store.current_summary(session_id) is None
        assert [m.id for m in service.store.messages(session_id)] == before
        assert not any(
            "Before compaction" in s.session.title for s in service.sessions.list_sessions()
        )
        await send(pilot, main, "Turn 16: still there?")  # the conversation goes on as it was
        report = main.last_report
        assert report is not None and report.view is not None and not report.view.summarized
