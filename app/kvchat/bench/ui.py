"""``kvchat bench --ui``: the app's own latencies, on the real app and the real model.

What a user feels, each measured up to the frame that shows it (Textual's compositor
output, caught where the app hands it to the terminal):

* first paint: process start → first frame (a fresh ``python`` that imports the app and
  runs it), and the app's own part, construction → first frame;
* session switch: Enter on a session in the sidebar → its visible messages drawn and the
  input focused, against the restore the switch started (``KV ready`` comes after that);
* search jump: Enter on a search hit → the hit drawn in its window of messages;
* keystroke echo while a reply streams: key press → the character drawn in the input.

The sessions live in a scratch KVCHAT_HOME. Nothing heavy is imported with this module.
The report and its bounds are in ``bench_report``, the first paint in ``bench_paint``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.bench.paint import SIZE, first_paint
from kvchat.bench.ui_report import LONG_SESSION, Switch, UiReport, format_ui_report

if TYPE_CHECKING:
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from kvchat.tui.app import KvchatApp
    from kvchat.tui.main import MainScreen

SEARCH_WORD = "zebra"
STORY = "Write a long story about a river village, in many short paragraphs."
# The reply typed over: a few hundred tokens, the same each run.
REPLY = {"temperature": 0.0, "seed": 0, "max_tokens": 400}
# How long a sent message may take until its prompt's read starts (or its reply's first
# piece comes), and from then to the first piece.
REPLY_START_S = 300.0
REPLY_READ_S = 300.0
Say = Callable[[str], None]


@dataclass
class Jump:
    """A search jump: Enter on a hit → the hit drawn, and where it landed."""

    ms: float
    mounted: int  # messages mounted after it
    hit_id: int  # the store id of the hit Enter was pressed on
    landed_id: int | None  # the message focused and drawn in the viewport
    landed_number: int | None  # its number in its session (1: the first)


@dataclass
class Echo:
    """Keystroke echo while a reply streams."""

    ms: list[float]  # each key's press → the frame that shows it
    streamed: int  # reply pieces drawn after the first timed key's frame


# --- the scratch home ---------------------------------------------------------------------


@dataclass
class Homes:
    a: str
    b: str
    long: str
    tokens: int


def build_sessions(service: ChatService, target: int, say: Say) -> Homes:
    """Two sessions of ~``target`` tokens with snapshots on disk, and one of
    ``LONG_SESSION`` short messages with one search word in message 5."""
    from kvchat.bench.runs import build_history

    long = service.sessions.new_session(title="bench long")
    for i in range(LONG_SESSION):
        text = f"the {SEARCH_WORD} message" if i == 4 else f"message {i} with **bold** text"
        service.sessions.add_message(
            long.id, "user" if i % 2 == 0 else "assistant", text, token_count=5
        )
    ids = []
    for seed in (1, 2):
        session_id = build_history(service, target, seed=seed)
        say(f"ui: prefilling a {target}-token session for its snapshot…")
        service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
        ids.append(session_id)
    # Leave nothing hot, nothing in RAM: the app starts as after a relaunch.
    tiers = service.host.tiers
    tiers.spill()
    tiers.warm.clear()
    service.engine.clear()
    snapshot = tiers.snapshot(ids[1])
    return Homes(ids[0], ids[1], long.id, snapshot.n_tokens if snapshot else 0)


# --- the Pilot-driven part ------------------------------------------------------------------


class _Frames:
    """Waits on predicates checked at every frame the app draws."""

    def __init__(self, app: KvchatApp) -> None:
        self.app = app
        self.waiting: list[tuple[Callable[[], bool], asyncio.Future[float]]] = []
        display = app._display

        def spy(screen: Any, renderable: Any) -> None:
            display(screen, renderable)
            if renderable is None or app._batch_count or not self.waiting:
                return
            now = time.perf_counter()
            for item in list(self.waiting):
                predicate, future = item
                if future.done():
                    self.waiting.remove(item)
                elif predicate():
                    future.set_result(now)
                    self.waiting.remove(item)

        app._display = spy  # type: ignore[method-assign]

    def when(self, predicate: Callable[[], bool]) -> asyncio.Future[float]:
        """The time of the first frame drawn from now on at which ``predicate()`` holds."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting.append((predicate, future))
        return future


def _drawn(main: MainScreen) -> bool:
    """Every message in the conversation's viewport has its Markdown rendered (not a note
    that it is being drawn in parts)."""
    conversation = main.conversation
    area = conversation.region
    views = conversation.views
    if not views:
        return False
    for view in views:
        region = view.region
        if region.bottom <= area.y or region.y >= area.bottom:
            continue
        if view.text and not view.body.rendered:
            return False
    return True


async def _wait(
    predicate: Callable[[], object], timeout: float = 300, what: str | None = None
) -> None:
    """Until ``predicate()`` holds; a RuntimeError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench --ui: timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


def _press(app: KvchatApp, key: str, character: str | None = None) -> None:
    """Deliver a key as the terminal driver does (Pilot.press waits for the app to idle)."""
    from textual import events

    event = events.Key(key, character)
    event.set_sender(app)
    assert app._driver is not None
    app._driver.send_message(event)


async def _switch(app: KvchatApp, frames: _Frames, session_id: str) -> Switch:
    main = app.main
    main.sessions.focus()
    await _wait(lambda: app.focused is main.sessions)
    await _wait(lambda: not any(w.is_running for w in main.workers))  # the sidebar refreshed
    await asyncio.sleep(0.2)
    rows = main.sessions.rows
    target = next(i for i, r in enumerate(rows) if r.id == session_id)
    # Down the list with keys, as a user moves to the session (keys count as activity:
    # the app's garbage collection waits for an idle moment; see kvchat.tui.collector).
    while main.sessions.index != target:
        index = main.sessions.index
        _press(app, "down" if index is None or index < target else "up")
        await _wait(lambda index=index: main.sessions.index != index)  # type: ignore[misc]
        await asyncio.sleep(0.1)
    before = main.last_restore
    drawn = frames.when(
        lambda: main.shown_id == session_id and app.focused is main.prompt and _drawn(main)
    )
    ready = frames.when(lambda: main.hot_id == session_id and main.last_restore is not before)
    started = time.perf_counter()
    _press(app, "enter")
    drawn_at, ready_at = await asyncio.wait_for(asyncio.gather(drawn, ready), 300)
    restore = main.last_restore
    assert restore is not None
    drawn_ms = (drawn_at - started) * 1000
    return Switch(
        source=restore.source,
        tokens=restore.tokens,
        drawn_ms=drawn_ms,
        ready_ms=(ready_at - started) * 1000,
        restore_ms=restore.ms,
        over_restore_ms=drawn_ms - restore.ms,
    )


async def _jump(app: KvchatApp, frames: _Frames, word: str = SEARCH_WORD) -> Jump:
    """Ctrl+F, ``word`` (one hit), Enter: the time to the frame that draws the hit."""
    from kvchat.tui.screens.search import SearchScreen
    from kvchat.tui.widgets.conversation import MessageView

    main = app.main
    main.prompt.focus()
    await _wait(lambda: app.focused is main.prompt)
    _press(app, "ctrl+f")
    await _wait(lambda: isinstance(app.screen, SearchScreen))
    for ch in word:
        _press(app, ch, ch)
    await _wait(lambda: len(getattr(app.screen, "hits", ())) == 1)
    await asyncio.sleep(0.2)
    hit_id = app.screen.hits[0].message.id  # type: ignore[attr-defined]
    landed: list[MessageView] = []

    def shown() -> bool:
        focused = app.focused
        if not isinstance(focused, MessageView) or word not in focused.text:
            return False
        area = main.conversation.region
        inside = area.y <= focused.region.y < area.bottom
        if inside and focused.body.rendered:
            landed.append(focused)
            return True
        return False

    hit = frames.when(shown)
    started = time.perf_counter()
    _press(app, "enter")
    hit_at = await asyncio.wait_for(hit, 300)
    await _wait(lambda: main.hot_id == main.session_id)
    view = landed[0]
    return Jump(
        ms=(hit_at - started) * 1000,
        mounted=len(main.conversation.views),
        hit_id=hit_id,
        landed_id=view.message_id,
        landed_number=view.number,
    )


async def _echo(
    app: KvchatApp,
    frames: _Frames,
    keys: int,
    say: Say,
    start_s: float = REPLY_START_S,
    read_s: float = REPLY_READ_S,
) -> Echo:
    """Type while a reply streams (sent in the open session: its prompt's read starts
    within ``start_s`` seconds, its first piece comes ``read_s`` seconds after); each key's
    time to the frame that shows it. A key counts only
    when the reply drew a piece after that frame: the keys typed after its last piece
    (the reply done, its turn still being stored) are not typed while it streams."""
    main = app.main
    latencies: list[float] = []
    streamed = 0
    for _attempt in range(3):
        main.prompt.focus()
        await _wait(lambda: app.focused is main.prompt)  # focus moves after this frame
        main.prompt.clear()
        main.prompt.insert(STORY)
        before = main.last_turn
        _press(app, "enter")
        await _wait(
            lambda: main.turn is not None and (main.turn.pieces or main.turn.progress),
            start_s,
            f"the prompt's read to start ({start_s:.0f} s)",
        )
        await _wait(
            lambda: main.turn is not None and main.turn.pieces > 0,
            read_s,
            f"the reply's first piece ({read_s:.0f} s after the read started)",
        )
        turn = main.turn
        assert turn is not None
        main.prompt.focus()
        typed = ""
        timed: list[tuple[float, int]] = []  # each key's echo, and the reply's pieces then
        wanted = keys - len(latencies)
        while main.turn is turn and sum(p < turn.pieces for _, p in timed) < wanted:
            ch = "abcdefghijklmnopqrstuvwxyz"[len(typed) % 26]
            expected = main.prompt.text + ch
            echoed = frames.when(lambda expected=expected: main.prompt.text == expected)  # type: ignore[misc]
            started = time.perf_counter()
            _press(app, ch, ch)
            at = await asyncio.wait_for(echoed, 30)
            typed += ch
            if main.turn is turn:  # still its turn when it was drawn
                timed.append(((at - started) * 1000, turn.pieces))
            await asyncio.sleep(0.06)  # a fast typist: ~10 keys a second
        if main.turn is turn:
            _press(app, "escape")
        await _wait(lambda before=before: main.turn is None and main.last_turn is not before)  # type: ignore[misc]
        # Pieces only grow: the keys with a piece drawn after them come first.
        counted = [(ms, p) for ms, p in timed if p < turn.pieces][:wanted]
        latencies += [ms for ms, _ in counted]
        if counted:
            streamed += turn.pieces - counted[0][1]
        main.prompt.clear()
        if len(latencies) >= keys:
            break
        say(f"ui: the reply ended after {len(latencies)} keys; another one…")
    return Echo(latencies, streamed)


async def _drive(app: KvchatApp, homes: Homes, rounds: int, keys: int, say: Say) -> UiReport:
    report = UiReport()
    async with app.run_test(size=SIZE):
        frames = _Frames(app)
        main = app.main
        await _wait(lambda: main.ready and main.last_restore is not None)
        service = app.service
        assert service is not None
        for _ in range(rounds):
            for session_id in (homes.a, homes.b):  # from disk
                await app.engine_thread.run(service.host.tiers.warm.clear)
                report.switches.append(await _switch(app, frames, session_id))
            for session_id in (homes.a, homes.b):  # from RAM
                report.switches.append(await _switch(app, frames, session_id))
        say("ui: search jump…")
        jump = await _jump(app, frames)
        report.jump_ms, report.jump_messages = jump.ms, jump.mounted
        await _switch(app, frames, homes.a)
        say("ui: typing while a reply streams…")
        report.echo_ms = (await _echo(app, frames, keys, say)).ms
        # Quit as a user does, from the app's own loop: awaiting action_quit from here
        # raced run_test's shutdown with the app's exit, and the exit never finished.
        _press(app, "ctrl+q")
        await _wait(lambda: app._closed, 120)
    return report


def run_ui_bench(
    settings: Settings, sizes: list[int], *, repeat: int = 3, progress: Say | None = None
) -> UiReport:
    """Build the sessions in a scratch home, measure the first paint in fresh processes,
    then drive the app with Pilot."""
    from kvchat.bench.runs import machine
    from kvchat.service.chat import ChatService
    from kvchat.tui.app import KvchatApp

    say = progress or (lambda _line: None)
    settings = settings.model_copy(update=REPLY)
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-ui-") as scratch:
        home = Path(scratch)
        service = ChatService(settings, home=home)
        try:
            engine = service.load_engine()
            room = engine.n_ctx - settings.max_tokens - 200
            fitting = [s for s in sizes if s <= room]
            if not fitting:
                raise RuntimeError(
                    f"no size of {sizes} leaves room for a reply in n_ctx={engine.n_ctx}"
                )
            target = max(fitting)
            homes = build_sessions(service, target, say)
            info = machine(engine)
        except BaseException:
            service.close()
            raise
        say("ui: first paint in fresh processes…")
        runs = max(3, repeat)
        paint = first_paint(home, runs)
        command = first_paint(home, runs, mode="command")
        app = KvchatApp(settings, service, cursor_blink=False)
        old_home = os.environ.get("KVCHAT_HOME")
        os.environ["KVCHAT_HOME"] = scratch  # exports and copies stay in the scratch home
        try:
            rounds = 2 if repeat >= 3 else 1
            report = asyncio.run(_drive(app, homes, rounds, min(60, 12 * max(1, repeat)), say))
        finally:
            app.shutdown()
            if old_home is None:
                os.environ.pop("KVCHAT_HOME", None)
            else:
                os.environ["KVCHAT_HOME"] = old_home
    report.machine = {**info, "session_tokens": homes.tokens}
    report.import_ms = paint["import_ms"]
    report.first_paint_ms = paint["total_ms"]
    report.first_paint_app_ms = paint["app_ms"]
    report.first_paint_command_ms = command["total_ms"]
    return report


__all__ = ["UiReport", "format_ui_report", "run_ui_bench"]
