"""Figures that last (issue 41, item 8): F3 shows a reply's figures kept in the database
after a restart (with the model that wrote it), an imported reply says none were kept, the
live tok/s while a reply streams, and Shift+F5 copies the whole conversation. The real app
and store with the snapshot tests' stand-in for the model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import Settings
from kvchat.kvcache import RestoreResult
from kvchat.service.reports import TokenCounts, TurnReport, figures_of
from kvchat.tui.main.screen_state import ActiveTurn
from kvchat.tui.main.turns import LIVE_RATE_AFTER_S, live_rate
from kvchat.tui.screens.details import DetailsDialog
from tests.unit.tui.test_keys_and_copy import service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _seed(service: StandInService, *, figures: bool) -> tuple[str, int]:
    """A session of one exchange, its reply's figures kept when ``figures``; its id and the
    reply's id."""
    session = service.sessions.new_session("Kept figures")
    service.store.add_message(session.id, "user", "Hi there", token_count=5)
    reply = service.store.add_message(session.id, "assistant", "Hello!", token_count=48)
    if figures:
        report = TurnReport(
            session_id=session.id,
            reply="Hello!",
            tokens=TokenCounts(prompt=57, reused=0, decoded=57, generated=48),
            restore=RestoreResult("none", reason="no snapshot saved for this session yet"),
            ttft_ms=310.0,
            tokens_per_s=42.5,
            finish_reason="stop",
            message_id=reply.id,
        )
        service.store.record_figures(reply.id, figures_of(report, MODEL))
    return session.id, reply.id


async def _details_of_the_last_reply(service: StandInService) -> str:
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("f3")
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text: str = app.screen.text  # type: ignore[attr-defined]
        await pilot.press("escape")
    return text


async def test_f3_shows_the_figures_kept_after_a_restart(service: StandInService) -> None:
    _seed(service, figures=True)
    text = await _details_of_the_last_reply(service)  # a new app: no figures of this run
    assert f"Model: {MODEL}" in text
    assert "Generated: 48 tokens at 42.5 tok/s in 1.4 s" in text
    assert "First token after: 310 ms" in text
    assert "Prompt: 57 tokens (0 reused, 57 decoded)" in text
    assert "KV: full prefill: no snapshot saved for this session yet" in text
    assert "since kvchat started" not in text


async def test_f3_on_a_reply_with_no_figures_says_so(service: StandInService) -> None:
    _seed(service, figures=False)
    text = await _details_of_the_last_reply(service)
    assert "Figures: none kept (a reply imported, or stored before kvchat kept them)" in text


async def test_shift_f5_copies_the_whole_conversation(service: StandInService) -> None:
    session_id, _ = _seed(service, figures=False)
    for i in range(30):  # more than the screen shows: copied from the store, not the views
        service.store.add_message(session_id, "user", f"question {i}", token_count=3)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("f17")  # what a terminal sends for Shift+F5
        await _wait(lambda: "question 29" in app.clipboard)
        assert app.clipboard == service.sessions.export(session_id, "md")
        assert "Hi there" in app.clipboard and "Hello!" in app.clipboard
        await _wait(lambda: any("Copied the conversation" in n.message for n in app._notifications))


def test_the_live_rate_counts_from_the_first_piece_drawn() -> None:
    turn = ActiveTurn("send", "s", "Hi")
    assert live_rate(turn) == ""
    turn.pieces = 5
    turn.first_drawn = (100.0, 5)
    assert live_rate(turn, now=100.0 + LIVE_RATE_AFTER_S / 2) == ""  # too soon to say
    turn.pieces = 65
    assert live_rate(turn, now=102.0) == " · 30 tok/s"


class StreamingService(StandInService):
    """The stand-in whose reply streams 60 pieces over about 1.5 s before its fixed end."""

    def answer(self, session_id: str, message_id: int, **kwargs: Any) -> Any:
        on_token = kwargs.get("on_token")
        for _ in range(60):
            if on_token is not None:
                on_token("word ")
            time.sleep(0.025)
        return super().answer(session_id, message_id, **kwargs)


@pytest.fixture
def streaming(kvhome: Path) -> StreamingService:
    return StreamingService(Settings(n_ctx=8192, n_threads=1))


async def test_the_status_line_counts_tok_s_while_a_reply_streams(
    streaming: StreamingService,
) -> None:
    _seed(streaming, figures=False)
    app, run = start(streaming)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.prompt.insert("Go on")
        await pilot.press("enter")
        seen: list[str] = []

        def rate_shown() -> bool:
            seen.append(main.status.turn_text)
            return "tok/s" in main.status.turn_text and main.turn is not None

        await _wait(rate_shown, timeout=20)
        text = main.status.turn_text
        assert text.startswith("generating · ") and text.endswith("tok/s  (Esc stops)"), text
        assert text.split(" · ")[2].split()[0].replace(",", "").isdigit(), (
            text
        )  # no timing asserted
        await _wait(lambda: main.turn is None)
