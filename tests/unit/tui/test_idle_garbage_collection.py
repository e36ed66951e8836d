"""Garbage collection waits for an idle moment: a full collection took
100-160 ms with the app's objects, and landed in nearly every session switch as a frame
drawn late. The app freezes its start-up objects, turns Python's own full collections
off, and collects when the user has been idle (or when one is long overdue)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.collector import IDLE_S, NEVER, OVERDUE_S, IdleCollector
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def full_collections() -> int:
    return int(gc.get_stats()[2]["collections"])


@pytest.fixture
def clock() -> Iterator[Clock]:
    gc.unfreeze()
    saved = gc.get_threshold()
    yield Clock()
    gc.unfreeze()
    gc.set_threshold(*saved)


def test_full_collections_wait_for_the_user_to_be_idle(clock: Clock) -> None:
    busy = False
    collector = IdleCollector(busy=lambda: busy, clock=clock)
    young, middle, _ = gc.get_threshold()
    assert not collector.tick()  # not started: Python's defaults rule
    assert gc.get_freeze_count() == 0
    collector.start()
    assert gc.get_threshold() == (young, middle, NEVER)
    assert gc.get_freeze_count() > 0  # what the app holds once up is never walked again

    collector.touch()  # a key
    clock.now += IDLE_S / 2
    before = full_collections()
    assert not collector.tick() and full_collections() == before
    clock.now += IDLE_S
    assert collector.tick() and full_collections() == before + 1

    busy = True  # a reply streams: no collection, however long since the last key
    clock.now += IDLE_S * 10
    assert not collector.tick()
    busy = False
    assert not collector.tick()  # idle counts from the end of the reply
    clock.now += IDLE_S
    assert collector.tick() and full_collections() == before + 2


def test_an_idle_stretch_gets_one_collection_not_one_a_tick(clock: Clock) -> None:
    collector = IdleCollector(busy=lambda: False, clock=clock)
    collector.start()
    collector.touch()
    clock.now += IDLE_S
    before = full_collections()
    assert collector.tick()
    for _ in range(int(OVERDUE_S * 3 / 0.5)):  # three minutes idle, ticked as the app does
        clock.now += 0.5
        assert not collector.tick()
    assert full_collections() == before + 1
    collector.touch()  # back: the next pause gets its collection
    clock.now += IDLE_S
    assert collector.tick()


def test_an_overdue_collection_runs_even_while_busy_and_stop_restores_the_defaults(
    clock: Clock,
) -> None:
    saved = gc.get_threshold()
    collector = IdleCollector(busy=lambda: True, clock=clock)
    collector.start()
    clock.now += OVERDUE_S / 2
    assert not collector.tick()
    clock.now += OVERDUE_S
    before = full_collections()
    assert collector.tick() and full_collections() == before + 1
    collector.stop()
    assert gc.get_threshold() == saved and gc.get_freeze_count() == 0


async def test_the_app_collects_when_idle_and_gives_python_its_defaults_back(
    kvhome: Path,
) -> None:
    gc.unfreeze()
    saved = gc.get_threshold()
    service = StandInService(Settings(n_ctx=8192, n_threads=1))
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await _settled(pilot)
        await _wait(lambda: app.collector.started)
        assert gc.get_threshold()[2] == NEVER
        await pilot.press("a")  # typing: the next collection waits for a pause
        pressed, before = time.monotonic(), app.collector.collections
        await _wait(lambda: app.collector.collections > before, timeout=IDLE_S * 4)
        assert time.monotonic() - pressed >= IDLE_S * 0.9
    assert gc.get_threshold() == saved and gc.get_freeze_count() == 0
