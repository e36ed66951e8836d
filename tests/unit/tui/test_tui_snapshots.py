"""Snapshot tests (pytest-textual-snapshot) of the main screen, the help screen and the
first-run empty state, at 100×30 (and the main screen at 80×24, the smallest supported).

Pictures must not change from run to run, so these use a deterministic stand-in for
the model (``StandInService``: the real ChatService and store, a fake engine with fixed
figures). Nothing here claims anything about resume, reuse or output: tests/e2e/tui/test_tui.py
does that with the real model. The libraries that draw them (Textual, Rich, Pygments) are
pinned in the test extra: a new minor version recolours the pictures (Pygments 2.21 did).
Update with ``pytest tests/unit/tui/test_tui_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from textual.pilot import Pilot

from kvchat.config import Settings
from kvchat.kvcache import RestoreResult
from kvchat.service.chat import ChatService, TokenCounts, TurnReport
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.help import HelpScreen

SIZE = (100, 30)

REPLY = """\
Use `sorted` with a key:

```python
people = [("Ada", 36), ("Alan", 41)]
print(sorted(people, key=lambda p: p[1]))
```

It returns a **new** list; `list.sort` sorts in place."""


class FakeEngine:
    """Just what the UI reads from an engine: name, sizes, token count."""

    n_ctx = 8192

    def __init__(self) -> None:
        self.n_tokens = 0
        self.config = SimpleNamespace(model_path=Path("SmolLM2-135M-Instruct.Q4_1.gguf"))

    def close(self) -> None:
        pass


class StandInService(ChatService):
    """The real service over the real store, with a fake engine and fixed turn figures."""

    # Its own record of the hot session (the real one lives in the service's KV tiers).
    hot_session_id: str | None = None
    fake: FakeEngine | None = None

    def load_engine(self) -> Any:
        if self.fake is None:
            self.fake = FakeEngine()
        return self.fake

    @property
    def engine(self) -> Any:
        return self.load_engine()

    @property
    def context_tokens(self) -> int:
        return self.fake.n_tokens if self.fake is not None else 0

    def kv_location(self, session_id: str) -> str:
        if session_id == self.hot_session_id:
            return "hot"
        return "disk" if self.store.messages(session_id) else "none"

    def make_hot(self, session_id: str, *, no_restore: bool = False) -> RestoreResult:
        self.hot_session_id = session_id
        tokens = 3812 if self.store.messages(session_id) else 0
        self.engine.n_tokens = tokens
        if not tokens:
            return RestoreResult("none", reason="no snapshot saved for this session yet")
        return RestoreResult("disk", ms=41, bytes=tokens * 23052, tokens=tokens)

    def answer(
        self, session_id: str, message_id: int, *, on_token: Any = None, **_: Any
    ) -> TurnReport:
        """The turn on the message the app stored (``post``): a fixed reply."""
        asked = self.store.get_message(message_id)
        self.store.update_message(message_id, asked.content, False, token_count=9)
        for word in REPLY.split(" "):
            if on_token is not None:
                on_token(word + " ")
        message = self.store.add_message(session_id, "assistant", REPLY, token_count=62)
        self.engine.n_tokens += 96
        return TurnReport(
            session_id=session_id,
            reply=REPLY,
            tokens=TokenCounts(prompt=3837, reused=3812, decoded=25, generated=62),
            restore=RestoreResult("hot", tokens=3812),
            ttft_ms=48,
            tokens_per_s=31,
            finish_reason="stop",
            message_id=message.id,
        )


@pytest.fixture
def service(kvhome: Path) -> StandInService:
    return StandInService(Settings(n_ctx=8192, n_threads=1))


async def _wait(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _settled(pilot: Pilot[None]) -> None:
    app: KvchatApp = pilot.app  # type: ignore[assignment]
    main = app.main
    await _wait(lambda: main.ready)
    await _wait(lambda: main.session_id is None or main.last_restore is not None)
    await _wait(lambda: not any(w.is_running for w in main.workers))
    await pilot.pause()


def test_first_run_empty_state(snap_compare: Any, service: StandInService) -> None:
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=_settled)


@pytest.mark.parametrize("size", [SIZE, (80, 24)], ids=["100x30", "80x24"])
def test_main_screen(snap_compare: Any, service: StandInService, size: tuple[int, int]) -> None:
    # Oldest first (the sidebar shows the most recently updated first; ties by creation).
    service.sessions.new_session("Empty chat")
    older = service.sessions.new_session("Rust lifetimes")
    service.store.add_message(older.id, "user", "What is a lifetime?", token_count=7)
    session = service.sessions.new_session("Sort a list of tuples")
    service.store.add_message(session.id, "user", "How do I sort tuples by age?", token_count=9)
    service.store.add_message(session.id, "assistant", "By the second item.", token_count=5)

    async def run_before(pilot: Pilot[None]) -> None:
        await _settled(pilot)
        app: KvchatApp = pilot.app  # type: ignore[assignment]
        main = app.main
        main.prompt.insert("And in reverse?")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        main.prompt.insert("Thanks! One more question:")

    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_help_screen(snap_compare: Any, service: StandInService) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await _settled(pilot)
        await pilot.press("f1")
        await _wait(lambda: isinstance(pilot.app.screen, HelpScreen))
        await pilot.pause()

    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
