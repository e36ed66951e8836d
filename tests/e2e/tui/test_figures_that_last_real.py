"""Figures that last, with the real model (issue 41, item 8): an imported conversation gets
its token count once opened (stored: ``kvchat list`` says the same), the app's list and
``kvchat list`` agree on a session's tokens after a turn, and F3 shows the turn's figures
after a relaunch, as they were. Asserted by counts, never by timings."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.service.chat import ChatService
from kvchat.tui.screens.details import DetailsDialog
from tests.conftest import run_cli
from tests.e2e.tui.test_tui import SIZE, make_app, make_settings, ready, send, wait_until
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)

TURNS = [
    {"role": "user", "content": "Name three colours of the rainbow."},
    {"role": "assistant", "content": "Red, orange and yellow are three of them."},
    {"role": "user", "content": "And the other four?"},
    {"role": "assistant", "content": "Green, blue, indigo and violet."},
]


def _listed(home: Path) -> dict[str, dict[str, object]]:
    return {item["id"]: item for item in run_cli(home, "list", "--json").json}


async def test_imported_tokens_agree_and_f3_keeps_the_figures(kvhome: Path, tmp_path: Path) -> None:
    source = tmp_path / "rainbow.json"
    source.write_text(json.dumps(TURNS), encoding="utf-8")
    run_cli(kvhome, "import", str(source))
    [item] = _listed(kvhome).values()
    session_id = str(item["id"])
    assert item["tokens"] == 0 and item["messages"] == 4  # imported: no counts yet

    # Counted by the model once the session is open; stored, so the CLI says the same.
    service = ChatService(make_settings())
    engine = service.host.token_engine()
    expected = sum(len(engine.tokenize(t["content"])) for t in TURNS)
    service.close()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == session_id
        await wait_until(lambda: _summary_tokens(main, session_id) == expected)
        assert _listed(kvhome)[session_id]["tokens"] == expected
        # After a turn (and its snapshot) the list and kvchat list show one figure.
        await send(pilot, main, "Which one is last?")
        report = main.last_report
        assert report is not None and report.message_id is not None
        assert report.tokens.decoded == report.tokens.prompt  # no snapshot before: all read
        row = main.sessions.row(session_id)
        assert row is not None
        shown = row.tokens
        assert shown == main.status.used > expected
        assert _listed(kvhome)[session_id]["tokens"] == shown
        generated, rate = report.tokens.generated, report.tokens_per_s
        reply_id = report.message_id
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)

    # A relaunch: F3 on the reply shows that turn's figures, kept in the database.
    again = make_app()
    async with again.run_test(size=SIZE) as pilot:
        main = await ready(again)
        assert main.session_id == session_id and not main.turn_figures
        await pilot.press("f3")
        await wait_until(lambda: isinstance(again.screen, DetailsDialog))
        text = again.screen.text  # type: ignore[attr-defined]
        assert "Model: SmolLM2-135M-Instruct" in text
        assert f"Generated: {generated:,} tokens at {rate:,.1f} tok/s" in text
        assert (
            f"Prompt: {report.tokens.prompt:,} tokens (0 reused, {report.tokens.decoded:,}" in text
        )
        assert "KV: full prefill" in text
        assert main.conversation.views[-1].message_id == reply_id
        assert _listed(kvhome)[session_id]["tokens"] == shown


def _summary_tokens(main: object, session_id: str) -> int | None:
    """The session's stored size as the app's list holds it (its summary, not the live
    context the open row shows)."""
    rows = main.sessions._all  # type: ignore[attr-defined]
    row = next((r for r in rows if r.id == session_id), None)
    return None if row is None else row.summary.size
