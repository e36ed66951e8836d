"""The screen keeps updating while dialogs are open during a reply (issue 41, item 3).

A reply streams from the engine thread (the stand-in service of test_tui_snapshots, with a
reply of many small pieces) while each dialog is opened in turn: details (F3), session
settings (Ctrl+G), search (Ctrl+F), export (Ctrl+S), help (F1), rename (F2), the code
blocks (F5). What reaches the terminal is read from the frames the app draws: the status
bar's token count must keep growing in them while the dialog is open, and the reply's
shown text must grow. The model picker (F9) and the attach picker (Ctrl+\\) are refused
during a reply (with a notice) and the frames go on too. Then two screens over the
conversation (a dialog, and the command palette over it): before kvchat.tui.stacked the
frames showed the reply frozen there (one token count for the whole time the palette was
open) until a resize or until the palette closed."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import Settings
from kvchat.kvcache import RestoreResult
from kvchat.service.chat import TokenCounts, TurnReport
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from tests.unit.tui.test_tui_snapshots import StandInService

PIECES = 4000
PIECE_S = 0.01
DRAWN = re.compile(r"generating · ([\d,]+) tokens")
DIALOGS = {
    "f3": "DetailsDialog",
    "ctrl+g": "SettingsDialog",
    "ctrl+f": "SearchScreen",
    "ctrl+s": "ExportDialog",
    "f1": "HelpScreen",
    "f2": "TextDialog",
    "f5": "CodePickerDialog",
    "f9": None,  # refused during a reply
    "ctrl+backslash": None,
    # Two screens over the conversation: a dialog, then the command palette over it.
    "f3 ctrl+p": "CommandPalette",
    "ctrl+g ctrl+p": "CommandPalette",
}
# The default run opens one of each kind (a dialog, a search screen, a refusal, two stacked
# screens); ``stress`` opens every one.
SAMPLE = ("f3", "ctrl+f", "f9", "ctrl+g ctrl+p")


class StreamingService(StandInService):
    """The stand-in whose reply streams a piece every PIECE_S from the engine thread."""

    def answer(
        self,
        session_id: str,
        message_id: int,
        *,
        on_token: Any = None,
        cancel: Any = None,
        **_: Any,
    ) -> TurnReport:
        asked = self.store.get_message(message_id)
        self.store.update_message(message_id, asked.content, False, token_count=9)
        pieces: list[str] = []
        for i in range(PIECES):
            if cancel is not None and cancel():
                break
            pieces.append(f"w{i} " + ("\n\n" if i % 9 == 8 else ""))
            if on_token is not None:
                on_token(pieces[-1])
            time.sleep(PIECE_S)
        reply = "".join(pieces)
        cut = len(pieces) < PIECES
        message = self.store.add_message(
            session_id, "assistant", reply, token_count=len(pieces), partial=cut
        )
        return TurnReport(
            session_id=session_id,
            reply=reply,
            tokens=TokenCounts(prompt=9, reused=0, decoded=9, generated=len(pieces)),
            restore=RestoreResult("hot", tokens=0),
            ttft_ms=1,
            tokens_per_s=1 / PIECE_S,
            finish_reason="cancelled" if cut else "length",
            message_id=message.id,
        )


@pytest.fixture
def service(kvhome: Path) -> StreamingService:
    service = StreamingService(Settings(n_ctx=8192, n_threads=1))
    session = service.sessions.new_session("Code")
    service.store.add_message(session.id, "user", "Two blocks?", token_count=3)
    blocks = "```py\nprint(1)\n```\n\n```py\nprint(2)\n```"
    service.store.add_message(session.id, "assistant", blocks, token_count=12)
    service.sessions.remember_open(session.id)
    return service


async def wait_until(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
        await asyncio.sleep(0.02)


def shown_text(main: MainScreen) -> str:
    turn = main.turn
    return turn.view.text if turn is not None and turn.view is not None else ""


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param(SAMPLE, id="sample"),
        pytest.param(tuple(DIALOGS), id="every", marks=pytest.mark.stress),
    ],
)
async def test_frames_keep_coming_with_each_dialog_open_during_a_reply(
    service: StreamingService, keys: tuple[str, ...]
) -> None:
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    drawn: list[int] = []  # the token count the status bar showed, frame by frame
    display = app._display

    def spy(screen: Any, renderable: Any) -> None:
        if renderable is not None:
            text = "".join(s.text for s in app.console.render(renderable) if not s.control)
            counts = [int(n.replace(",", "")) for n in DRAWN.findall(text)]
            if counts:
                drawn.append(max(counts))
        display(screen, renderable)

    app._display = spy  # type: ignore[method-assign]
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        await wait_until(lambda: main.ready and main.last_restore is not None)
        main.prompt.insert("Go on for a while")
        await pilot.press("enter")
        await wait_until(lambda: shown_text(main))
        try:
            await _each_dialog(app, main, pilot.press, drawn, keys)
        finally:  # the reply stops (its thread would run on past a failure)
            if main.turn is not None:
                main.turn.cancel.set()
            await wait_until(lambda: main.turn is None)
        app.simulate_key("ctrl+q")
        await wait_until(lambda: app._closed)
    assert app.worker_errors == []


async def _each_dialog(
    app: KvchatApp,
    main: MainScreen,
    press: Callable[..., Any],
    drawn: list[int],
    keys: tuple[str, ...],
) -> None:
    """Open each dialog of ``keys`` in turn while the reply streams; frames must keep coming."""
    for key in keys:
        dialog = DIALOGS[key]
        start, shown = len(drawn), len(shown_text(main))
        for one in key.split():
            await press(one)
        if dialog is not None:
            await wait_until(lambda name=dialog: type(app.screen).__name__ == name)
        else:
            refused = "Wait for the model to be ready and idle"
            assert any(n.message == refused for n in app._notifications), key
        opened = len(drawn)
        await asyncio.sleep(0.8)
        assert main.turn is not None, "the reply ended before every dialog was tried"
        if dialog is not None:
            assert type(app.screen).__name__ == dialog
        during = drawn[opened:]
        assert len(set(during)) >= 3 and during == sorted(during), (key, drawn[start:])
        assert len(shown_text(main)) > shown, key
        while dialog is not None and not isinstance(app.screen, MainScreen):
            await press("escape")
