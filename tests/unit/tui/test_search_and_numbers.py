"""Messages show their number in the session; search snippets keep square brackets and
control markers; a jump to an old hit mounts its page and is never blank; the sidebar's
tokens match the gauge; the status shows what a turn wrote; counts have thousands
separators; message details on demand; widths stay readable. The real app with the
snapshot tests' stand-in for the model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from textual.content import Content
from textual.widgets import Label, OptionList

from kvchat.config import Settings
from kvchat.service.chat import SnapshotWrite, TurnReport
from kvchat.store import Message, SearchHit
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.palette import KvchatCommands
from kvchat.tui.phrases import saved_phrase, turn_lines
from kvchat.tui.screens.details import DetailsDialog
from kvchat.tui.screens.search import SearchScreen, hit_content
from kvchat.tui.widgets.conversation import SHOWN, MessageView
from kvchat.tui.widgets.sidebar import row_lines
from tests.e2e.tui.test_tui_branches import sidebar_lines
from tests.unit.tui.test_keys_and_copy import add_pairs, service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from
RUST = "Vec<String> and &[String]"


def header(view: MessageView) -> str:
    """The role line the message draws (its first line)."""
    return view.drawn_lines[0].strip()


# --- item 6: finding things ------------------------------------------------------------------


async def test_messages_show_their_number_in_the_session(service: StandInService) -> None:
    session = service.sessions.new_session("Long")
    add_pairs(service, session.id, 35)  # 70 messages: the last SHOWN are shown
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        stored = service.sessions.messages(session.id)
        views = main.conversation.views
        first = 70 - SHOWN + 1
        assert views[0].number == first and header(views[0]) == f"You · #{first}"
        assert header(views[-1]) == "Assistant · #70"
        for view in views:  # the number is the 1-based position `kvchat fork --at` takes
            assert view.number is not None and stored[view.number - 1].id == view.message_id
        main.prompt.insert("Next")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        assert [header(v) for v in main.conversation.views[-2:]] == ["You · #71", "Assistant · #72"]


async def test_search_snippets_keep_square_brackets(service: StandInService) -> None:
    session = service.sessions.new_session("Rust")
    service.store.add_message(session.id, "user", f"What is {RUST}?", token_count=9)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+f")
        await _wait(lambda: isinstance(app.screen, SearchScreen))
        search = app.screen
        assert isinstance(search, SearchScreen)
        # The store marks matches with "[" and "]": brackets in the text must survive that.
        await pilot.press(*"what")
        await _wait(lambda: len(search.hits) == 1)
        await pilot.pause()
        prompt = search.query_one("#hits", OptionList).get_option_at_index(0).prompt
        assert isinstance(prompt, Content)
        assert prompt.plain.endswith(f"What is {RUST}?"), prompt.plain
        marked = [prompt.plain[s.start : s.end] for s in prompt.spans if "reverse" in str(s.style)]
        assert marked == ["What"]


def test_search_snippets_with_control_markers() -> None:
    message = Message(1, "s", "user", f"What is {RUST}?", "2025-01-01T00:00:00+00:00", 9, False)
    hit = SearchHit(message, "Rust", "…is Vec<\x02String\x03> and &[\x02String\x03]?")
    content = hit_content(hit, "string")
    assert content.plain.endswith("…is Vec<String> and &[String]?")
    marked = [content.plain[s.start : s.end] for s in content.spans if "reverse" in str(s.style)]
    assert marked == ["String", "String"]


def _frames(app: KvchatApp, main: MainScreen, hit_text: str) -> list[tuple[int, bool, float]]:
    """Record every frame drawn from now on: (messages mounted, the hit shown, when).

    The hit is shown when its view is in the conversation's viewport with its Markdown
    rendered (not a note that it is being drawn in parts).
    """
    frames: list[tuple[int, bool, float]] = []
    display = app._display

    def spy(screen: Any, renderable: Any) -> None:
        if renderable is not None and not app._batch_count and screen is main:
            # What is drawn: a page that a show replaced is hidden until it is removed.
            views = [v for v in main.conversation.query(MessageView) if v.parent.display]
            hit = next((v for v in views if v.text == hit_text), None)
            area = main.conversation.region
            shown = hit is not None and area.y <= hit.region.y < area.bottom and hit.body.rendered
            frames.append((len(views), shown, time.perf_counter()))
        display(screen, renderable)

    app._display = spy  # type: ignore[method-assign]
    return frames


async def test_a_jump_to_an_old_hit_mounts_its_page_and_is_never_blank(
    service: StandInService,
) -> None:
    long = service.sessions.new_session("Long")
    for i in range(300):
        text = f"message {i} with **bold** text\n\n- one\n- two"
        if i == 4:
            text = "the zebra message"
        service.store.add_message(
            long.id, "user" if i % 2 == 0 else "assistant", text, token_count=5
        )
    other = service.sessions.new_session("Other")
    service.store.add_message(other.id, "user", "hello", token_count=1)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.session_id == other.id
        await pilot.press("ctrl+f")
        await _wait(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"zebra")
        await _wait(lambda: len(getattr(app.screen, "hits", ())) == 1)
        frames = _frames(app, main, "the zebra message")
        started = time.perf_counter()
        await pilot.press("enter")
        await _wait(
            lambda: isinstance(app.focused, MessageView) and app.focused.text == "the zebra message"
        )
        settled = time.perf_counter() - started
        # The jump: from Enter on the hit to the first frame that shows it.
        shown_at = next(t for _, shown, t in frames if shown) - started
        print(
            f"\njump to message #5 of 300: hit on screen after {shown_at * 1000:,.0f} ms "
            f"(open_session {main.last_jump_ms or 0:,.0f} ms; all work done after "
            f"{settled * 1000:,.0f} ms)"
        )
        # Every frame shows the session searched from, or the hit: none blank or elsewhere.
        # The first with the hit has only the messages from it that fill the screen (and
        # the two before it); the rest of its window of 12 follow below, frames later.
        shapes = [(n, shown) for n, shown, _ in frames]
        assert shapes and all(shape == (1, False) or shape[1] for shape in shapes), shapes
        hits = [n for n, shown in shapes if shown]
        assert hits[0] < 12 and hits == sorted(hits), shapes
        await _wait(lambda: len(main.conversation.views) == 12)
        views = main.conversation.views
        assert len(views) <= 12 and views[0].number == 3 and app.focused.number == 5  # type: ignore[union-attr]
        later = main.conversation.query_one("#later", Label)
        assert "286 later messages not shown" in str(later.content)
        # ↓ past the last shown message shows the latest ones again.
        views[-1].focus()
        await pilot.pause()
        await pilot.press("down")
        await _wait(lambda: main.conversation.later == 0 and len(main.conversation.views) == SHOWN)
        assert main.conversation.views[-1].number == 300


# --- item 7: numbers that agree -------------------------------------------------------------


def _info(app: KvchatApp, session_id: str) -> tuple[str, str]:
    """A session's sidebar figure ("3,812 tok") and badge."""
    row = app.main.sessions.row(session_id)
    assert row is not None
    title, lines = row_lines(row)[0], sidebar_lines(app.main)
    # Its title line (cut with "…" in a narrow sidebar), then the line under it.
    at = next(
        i
        for i, line in enumerate(lines)
        if line == title or (line.endswith("…") and title.startswith(line[:-1]))
    )
    below = lines[at + 1]
    return below.split(" · ")[0], below.split()[-1]


async def test_sidebar_tokens_match_the_gauge_and_an_empty_session_is_not_hot(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Sort")
    service.store.add_message(session.id, "user", "How do I sort?", token_count=7)
    service.store.add_message(session.id, "assistant", "sorted()", token_count=5)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.status.used == 3812  # what the stand-in restored
        await _wait(lambda: _info(app, session.id)[0] == "3,812 tok")
        assert _info(app, session.id)[1] == "hot"
        await pilot.press("ctrl+n")
        await _wait(lambda: main.session_id != session.id and main.hot_id == main.session_id)
        await _settled(pilot)
        empty = main.session_id
        assert empty is not None and main.status.used == 0
        info, badge = _info(app, empty)
        assert info == "0 tok" and badge == "none"
        # The other session: no KV saved (the stand-in saves none), so its messages' count.
        assert _info(app, session.id)[0] == "12 tok"


class SavingStandIn(StandInService):
    """A stand-in whose turns report a large snapshot of which little was written."""

    def answer(self, session_id: str, message_id: int, **kwargs: Any) -> TurnReport:
        report = super().answer(session_id, message_id, **kwargs)
        report.restore.source = "none"
        report.snapshot = SnapshotWrite(bytes=80_000_000, written=1_048_576, ms=9)
        return report


async def test_the_status_shows_what_a_turn_wrote(kvhome: Path) -> None:
    service = SavingStandIn(Settings(n_ctx=8192, n_threads=1))
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.prompt.insert("Hi")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        assert main.status.memory_text == "KV: hot · wrote 1.0 MiB to disk in 9 ms"


def test_counts_have_thousands_separators() -> None:
    report = TurnReport(
        session_id="s",
        reply="r",
        tokens=__import__("kvchat.service.chat", fromlist=["TokenCounts"]).TokenCounts(
            4321, 4000, 321, 1234
        ),
        restore=__import__("kvchat.kvcache", fromlist=["RestoreResult"]).RestoreResult(
            "disk", ms=41, bytes=1, tokens=4000
        ),
        ttft_ms=1500,
        tokens_per_s=31.25,
        finish_reason="length",
        snapshot=SnapshotWrite(bytes=10, written=0, ms=3),
    )
    lines = turn_lines(report)
    assert "Generated: 1,234 tokens at 31.2 tok/s" in lines
    assert "Prompt: 4,321 tokens (4,000 reused, 321 decoded)" in lines
    assert "First token after: 1,500 ms" in lines
    assert "KV: restored 4,000 tokens from disk in 41 ms" in lines
    assert "Ended: stopped at the token limit" in lines
    assert saved_phrase(report) == "saved: nothing new to write to disk"


# --- item 13: message details, widths -------------------------------------------------------


async def test_message_details_on_demand(service: StandInService) -> None:
    session = service.sessions.new_session("Figures")
    service.store.add_message(session.id, "user", "Earlier question", token_count=4)
    service.store.add_message(session.id, "assistant", "Earlier answer", token_count=6)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.conversation.views[1].focus()
        await pilot.pause()
        await pilot.press("f3")  # a reply stored without figures: its time and tokens
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert text.startswith("Message #2 · Assistant") and "Tokens: 6" in text
        assert "Time: " in text and "Figures: none kept (a reply imported" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)

        main.prompt.focus()
        main.prompt.insert("New question")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        main.prompt.focus()
        await pilot.press("f3")  # no message selected: the last reply
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert text.startswith("Message #4 · Assistant"), text
        assert "Generated: 62 tokens at 31.0 tok/s" in text
        assert "Prompt: 3,837 tokens (3,812 reused, 25 decoded)" in text
        assert "First token after: 48 ms" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)

    entries = {action for _, action, _ in KvchatCommands._entries(None)}  # type: ignore[arg-type]
    assert "message_details" in entries


@pytest.mark.parametrize(("width", "sidebar"), [(80, 28), (100, 28), (160, 40), (240, 44)])
async def test_sidebar_widens_and_messages_keep_a_readable_width(
    service: StandInService, width: int, sidebar: int
) -> None:
    session = service.sessions.new_session("A title long enough to be cut on a narrow terminal")
    service.store.add_message(session.id, "user", "word " * 200, token_count=200)
    app, run = start(service, (width, 30))
    async with run as pilot:
        await _settled(pilot)
        assert app.main.sessions.outer_size.width == sidebar
        assert app.main.conversation.views[0].outer_size.width <= 100
