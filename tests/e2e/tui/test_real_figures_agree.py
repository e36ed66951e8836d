"""With real turns, the app's numbers agree: message numbers, the message details and the
figures in the status and the sidebar are the same counts. The real app and model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.details import DetailsDialog
from tests.unit.tui.test_keys_and_copy import SIZE
from tests.unit.tui.test_search_and_numbers import _info, header
from tests.unit.tui.test_tui_snapshots import _settled, _wait

# --- with the real model: the figures of real turns -----------------------------------------


@pytest.fixture
def no_tmux(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TMUX", raising=False)
    yield


async def test_real_turns_numbers_details_and_figures_agree(kvhome: Path, no_tmux: None) -> None:
    settings = Settings(temperature=0, max_tokens=12, n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _wait(lambda: main.ready, 120)
        for text in ("Name a color.", "Name a fruit."):
            main.prompt.insert(text)
            before = main.last_turn
            await pilot.press("enter")
            await _wait(lambda b=before: main.last_turn is not b and main.turn is None, 120)
            await _wait(lambda: main.housekeeping_idle, 120)  # the settle and the save
        await _settled(pilot)
        report = main.last_report
        assert report is not None and report.snapshot.written > 0
        # The last reply, when cut at max_tokens, says so and how to go on (issue 11.4); an
        # earlier one cut says so too, from its stored finish reason (issue 22.4).
        first = app.service.sessions.messages(main.session_id)[1]  # type: ignore[union-attr,arg-type]
        cut = " · stopped at the token limit"
        assert [header(v) for v in main.conversation.views] == [
            "You · #1",
            "Assistant · #2" + (cut if first.finish_reason == "length" else ""),
            "You · #3",
            "Assistant · #4"
            + (f"{cut} (F12 continues)" if report.finish_reason == "length" else ""),
        ]
        # The memory line says what the turn wrote (a few chunks), not the snapshot's size.
        assert main.status.memory_text.startswith("KV: hot · wrote ")
        assert report.snapshot.written <= report.snapshot.bytes
        # One figure for the open session in the sidebar and the gauge.
        session_id = main.session_id
        assert session_id is not None
        await _wait(lambda: _info(app, session_id)[0] == f"{main.status.used:,} tok")
        assert main.status.used > 0 and _info(app, session_id)[1] == "hot"
        main.prompt.focus()
        await pilot.press("f3")
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert f"Generated: {report.tokens.generated:,} tokens at " in text
        assert f"({report.tokens.reused:,} reused, {report.tokens.decoded:,} decoded)" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)
        # Away from it, the session keeps that figure (its saved KV's), and a new empty
        # session is not badged hot.
        used = main.status.used
        await pilot.press("ctrl+n")
        await _wait(lambda: main.session_id != session_id and main.hot_id == main.session_id)
        await _settled(pilot)
        await _wait(lambda: _info(app, session_id)[0] == f"{used:,} tok")
        assert main.session_id is not None and _info(app, main.session_id)[1] == "none"
        app.simulate_key("ctrl+q")
        await _wait(lambda: app._closed, 60)
    assert app.return_code == 0
