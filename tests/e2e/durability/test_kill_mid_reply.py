"""A kill loses nothing shown (issue 41, item 2): ``kill -9`` of a kvchat while its reply
streams, the real model (SmolLM2-135M) in a child process. What was shown (the bytes
``kvchat ask`` wrote to its stdout, the text the app's reply showed) is stored but for the
last save interval's tokens (measured and printed); the draft typed in the app's input is
kept; the reply shows as cut off by the end of kvchat; the next start says kvchat did not
exit cleanly, once, and ``kvchat doctor`` lists the unclean end."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvchat.paths import bundled_model_path
from kvchat.service.streaming import STREAM_SAVE_EVERY_S, STREAMING
from tests.conftest import FAST, REPO, clean_env, run_cli

LONG_REPLY = "Write a long story about a fox who moves to a new town and meets everyone there."
# How late a save may come on a busy machine beyond its interval: a save waits up to 0.2 s
# for another writer, then its commit's fsync.
SLACK_S = 0.5
DRAFT = "And then what did he do"
UNCLEAN = "kvchat did not exit cleanly"


def _rows(home: Path, sql: str) -> list[tuple[object, ...]]:
    try:
        db = sqlite3.connect(home / "kvchat.db", timeout=5)
    except sqlite3.OperationalError:
        return []
    try:
        return db.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []  # not made yet
    finally:
        db.close()


def _reply(home: Path) -> tuple[str, int, str | None]:
    """The assistant's reply as stored: its text, whether partial, its finish reason."""
    rows = _rows(
        home, "SELECT content, partial, finish_reason FROM messages WHERE role='assistant'"
    )
    assert len(rows) == 1, rows
    content, partial, reason = rows[0]
    return str(content), int(str(partial)), None if reason is None else str(reason)


class Reader(threading.Thread):
    """Reads a child's output as it comes, keeping when each part arrived."""

    def __init__(self, stream: object) -> None:
        super().__init__(daemon=True)
        self.fd = stream.fileno()  # type: ignore[attr-defined]
        self.parts: list[tuple[float, bytes]] = []

    def run(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.parts.append((time.monotonic(), chunk))

    def text(self) -> str:
        return b"".join(c for _, c in list(self.parts)).decode("utf-8", errors="replace")

    def arrived(self, chars: int) -> float:
        """When the first ``chars + 1`` characters had come."""
        data = b""
        for at, chunk in self.parts:
            data += chunk
            if len(data.decode("utf-8", errors="ignore")) > chars:
                return at
        raise AssertionError(f"fewer than {chars + 1} characters came")


def _tokens(text: str) -> int:
    """``text``'s tokens in the bundled model's vocabulary."""
    from llama_cpp import Llama

    from kvchat.engine.llama import weight_repack

    with weight_repack(False):  # the vocabulary alone: no weights to repack
        vocab = Llama(str(bundled_model_path()), n_ctx=64, vocab_only=True, verbose=False)
    return len(vocab.tokenize(text.encode(), add_bos=False, special=False))


def _kill_when(proc: subprocess.Popen[bytes], ready: object, timeout: float = 240) -> float:
    """SIGKILL ``proc`` once ``ready()``; returns when (monotonic)."""
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None, "the child ended before it was killed"
        assert time.monotonic() < deadline, "timed out waiting to kill the child"
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return killed_at


def _gap(shown: str, stored: str, arrived: Callable[[int], float]) -> tuple[int, int, float]:
    """Checks that the stored reply is what was shown less only its last part, all of which
    came within one save interval (a save follows the first piece after each interval, so
    what a kill can lose came within one); returns that part's characters, its tokens and
    over how long it came (printed). ``arrived(n)``: when the first ``n + 1`` characters had
    been shown."""
    assert stored.strip(), stored
    if stored.startswith(shown):
        # A save came after the last frame the test heard of (the child reports what it
        # shows through a pipe; the kill can land before the next report): nothing lost.
        return 0, 0, 0.0
    assert shown.startswith(stored), (stored[-80:], shown[-80:])
    missing = shown[len(stored) :]
    if not missing:
        return 0, 0, 0.0
    span = arrived(len(shown) - 1) - arrived(len(stored))
    assert span <= STREAM_SAVE_EVERY_S + SLACK_S, (span, len(missing))
    return len(missing), _tokens(missing), span


def test_kill_9_of_kvchat_ask_mid_reply_keeps_what_was_shown(kvhome: Path) -> None:
    argv = [sys.executable, "-m", "kvchat", "ask", "--new", LONG_REPLY, "--temperature", "0"]
    argv += ["--max-tokens", "1500", "--n-ctx", "2048", "--threads", "1"]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(kvhome)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    reader = Reader(proc.stdout)
    reader.start()
    try:
        # Killed well into the reply, after a few saves.
        _kill_when(proc, lambda: len(reader.text()) >= 600)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    shown = reader.text()
    stored, partial, reason = _reply(kvhome)
    assert partial == 1 and reason == STREAMING  # cut off, never committed
    chars, tokens, span = _gap(shown, stored, reader.arrived)
    print(
        f"\nkvchat ask, kill -9 after {len(shown):,} characters shown: "
        f"{len(stored):,} stored, {chars} characters ({tokens} tokens, shown over "
        f"{span * 1000:,.0f} ms) shown but not stored (saves every {STREAM_SAVE_EVERY_S} s)"
    )
    messages = _rows(kvhome, "SELECT role, content FROM messages ORDER BY id")
    assert messages[0] == ("user", LONG_REPLY)

    # The next start says it, once; doctor lists it.
    first = run_cli(kvhome, "ask", "--new", "Hi", *FAST).stderr
    lines = [line for line in first.splitlines() if UNCLEAN in line]
    assert len(lines) == 1 and "cut off: kvchat ended" in lines[0], first
    assert UNCLEAN not in run_cli(kvhome, "ask", "--new", "Hi", *FAST).stderr
    doctor = run_cli(kvhome, "doctor").stdout
    assert "unclean end: the run started" in doctor and f"(pid {proc.pid})" in doctor, doctor


# --- the app ---------------------------------------------------------------------------------

APP_CHILD = """
import asyncio, json, sys, time
from kvchat.crashes import start_crash_log
from kvchat.paths import data_dir
start_crash_log(data_dir())  # as `kvchat` (no command) does
from kvchat.config import Settings
from kvchat.tui.app import KvchatApp

async def main() -> None:
    settings = Settings(temperature=0, max_tokens=1500, n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        while not main.ready:
            await asyncio.sleep(0.05)
        main.prompt.focus()
        main.prompt.insert(sys.argv[1])
        await pilot.press("enter")
        while main.turn is None or main.turn.view is None or not main.turn.view.text:
            await asyncio.sleep(0.02)
        view = main.turn.view
        # Typed while the reply streams (pasted, then its last key: each key is a frame of
        # a busy UI, and the reply would end first).
        main.prompt.insert(sys.argv[2][:-1])
        await pilot.press(sys.argv[2][-1])
        print(json.dumps({"typed": main.prompt.text, "at": time.monotonic()}), flush=True)
        while True:  # what the reply shows, as it grows
            shown = {"shown": view.text, "streaming": main.turn is not None}
            print(json.dumps({**shown, "at": time.monotonic()}), flush=True)
            await asyncio.sleep(0.02)

asyncio.run(main())
"""


def test_kill_9_of_the_app_mid_reply_keeps_the_draft_and_what_was_shown(kvhome: Path) -> None:
    draft = DRAFT
    proc = subprocess.Popen(
        [sys.executable, "-c", APP_CHILD, LONG_REPLY, draft],
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(kvhome)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    reader = Reader(proc.stdout)
    reader.start()

    def events() -> list[dict[str, object]]:
        out = []
        for line in reader.text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line still arriving
        return out

    def typed_at() -> float | None:
        return next((float(e["at"]) for e in events() if "typed" in e), None)  # type: ignore[arg-type]

    def shown_now() -> str:
        shown = [e for e in events() if "shown" in e]
        assert not shown or shown[-1]["streaming"], "the reply ended before the kill"
        return str(shown[-1]["shown"]) if shown else ""

    try:
        # Killed once the draft had a pause of 0.8 s (its save is due after 0.5 s), the
        # reply under way.
        _kill_when(
            proc,
            lambda: (
                (at := typed_at()) is not None
                and time.monotonic() - at > 0.8
                and len(shown_now()) >= 100
            ),
        )
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    typed = next(str(e["typed"]) for e in events() if "typed" in e)
    assert typed == draft
    shown = shown_now()
    shows = [(float(e["at"]), str(e["shown"])) for e in events() if "shown" in e]  # type: ignore[arg-type]

    def arrived(chars: int) -> float:
        return next(at for at, text in shows if len(text) > chars)

    stored, partial, reason = _reply(kvhome)
    assert partial == 1 and reason == STREAMING
    chars, tokens, span = _gap(shown, stored, arrived)
    print(
        f"\nthe app, kill -9 after {len(shown):,} characters shown: {len(stored):,} stored, "
        f"{chars} characters ({tokens} tokens, shown over {span * 1000:,.0f} ms) shown but "
        "not stored"
    )
    drafts = _rows(kvhome, "SELECT text FROM drafts")
    assert drafts == [(draft,)]

    # The next start: the draft in the input, the reply cut off, the line said.
    import asyncio

    asyncio.run(_relaunch(kvhome, draft, stored))


async def _relaunch(home: Path, draft: str, stored: str) -> None:
    from kvchat.tui.app import KvchatApp
    from tests.e2e.tui.test_tui import make_settings, ready, wait_until

    app = KvchatApp(make_settings(), cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        main = await ready(app)
        await wait_until(lambda: main.prompt.text == draft, 30)
        reply = main.conversation.views[-1]
        assert reply.text == stored
        assert reply.drawn_lines[0].strip() == "Assistant · #2 · cut off: kvchat ended"
        said = [n.message for n in app._notifications if UNCLEAN in n.message]
        assert len(said) == 1, [n.message for n in app._notifications]
        await pilot.pause()
