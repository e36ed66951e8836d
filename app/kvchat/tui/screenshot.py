"""Make the README screenshot with the app itself and the real model.

    python -m kvchat.tui.screenshot [assets/screenshot.svg]

Runs in a throw-away KVCHAT_HOME: two sessions, quit, relaunch (the last session comes
back from its snapshot on disk), one more turn, then ``App.save_screenshot``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textual.pilot import Pilot

    from kvchat.tui.app import KvchatApp

SIZE = (110, 34)


async def _wait(predicate: Callable[[], object], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not get there in time")
        await asyncio.sleep(0.05)


async def _send(app: KvchatApp, pilot: Pilot[None], text: str) -> None:
    main = app.main
    before = main.last_turn
    main.prompt.insert(text)
    await pilot.press("enter")
    await _wait(lambda: main.last_turn is not before and main.turn is None)


async def _make(out: Path) -> None:
    from kvchat.config import Settings
    from kvchat.tui.app import KvchatApp

    settings = Settings(temperature=0, max_tokens=160, n_ctx=4096, n_threads=1)
    first = KvchatApp(settings, cursor_blink=False)
    async with first.run_test(size=SIZE) as pilot:
        await _wait(lambda: first.main.ready)
        await _send(first, pilot, "What is the capital of France? One sentence.")
        await pilot.press("ctrl+n")
        await _wait(lambda: first.main.session_id is not None and not first.main.conversation.views)
        await _send(first, pilot, "Write a Python function that reverses a string.")
        first.simulate_key("ctrl+q")
        await _wait(lambda: first._closed)

    second = KvchatApp(settings, cursor_blink=False)
    async with second.run_test(size=SIZE) as pilot:
        main = second.main
        await _wait(lambda: main.ready and main.last_restore is not None)
        await _send(second, pilot, "Now show how to call it.")
        main.prompt.insert("Thanks!")
        await pilot.pause(0.5)
        second.save_screenshot(filename=out.name, path=str(out.parent))
        second.simulate_key("ctrl+q")
        await _wait(lambda: second._closed)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/screenshot.svg").resolve()
    with tempfile.TemporaryDirectory(prefix="kvchat-shot-") as home:
        os.environ["KVCHAT_HOME"] = home
        asyncio.run(_make(out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
