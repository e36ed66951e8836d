"""The app's garbage collection, moved to when nobody is waiting.

A full collection walks every object the process tracks (~150,000 in the app with two
long sessions open: Textual's widgets, styles and caches) and holds the interpreter's lock
while it does: 100-160 ms on a busy 2-core machine, measured with ``kvchat bench --ui``.
Python starts one whenever enough objects have survived, so one landed in nearly every
session switch, as a frame drawn late. Here the objects the app has once it is up are
frozen out of collections (they live as long as the app), automatic full collections
are off, and the app runs one when the user has been idle a moment, or when one is long
overdue. The young generations are still collected as usual: they are quick.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

# Idle this long (no key, no click, no reply streaming) before a full collection.
IDLE_S = 1.5
# A full collection runs at least this often, idle or not.
OVERDUE_S = 60.0
# Collections of the middle generation before Python starts a full one itself: never, in
# practice (the app runs them; see IdleCollector.tick).
NEVER = 1_000_000


class IdleCollector:
    """Freezes the start-up objects, turns automatic full collections off, and runs one on
    :meth:`tick` when the app is idle; :meth:`stop` puts Python's defaults back."""

    def __init__(self, busy: Callable[[], bool], clock: Callable[[], float] = time.monotonic):
        self._busy = busy
        self._clock = clock
        self._saved: tuple[int, int, int] | None = None
        self._active_at = clock()
        self._collected_at = clock()
        self.collections = 0

    @property
    def started(self) -> bool:
        return self._saved is not None

    def start(self) -> None:
        """Freeze what the app holds now (instant: no collection, which would be a pause
        right when the app becomes usable) and stop Python's own full collections."""
        if self._saved is not None:
            return
        self._saved = gc.get_threshold()
        gc.freeze()
        young, middle, _ = self._saved
        gc.set_threshold(young, middle, NEVER)
        self._collected_at = self._clock()

    def idle_seconds(self) -> float:
        """How long since the user last did something (or a reply last streamed)."""
        return self._clock() - self._active_at

    def touch(self) -> None:
        """The user did something: a collection now would be felt."""
        self._active_at = self._clock()

    def tick(self) -> bool:
        """Run a full collection if the app is idle (or one is overdue); whether it ran.

        Once per idle stretch: with nothing done since the last collection (no key, no
        click, no reply), there is nothing new to collect, and an idle app does no work.
        """
        if self._saved is None:
            return False
        now = self._clock()
        if self._busy():
            self._active_at = now  # idle counts from the end of the reply
        if self._active_at < self._collected_at:
            return False  # idle since the last collection
        idle = now - self._active_at >= IDLE_S
        if not idle and now - self._collected_at < OVERDUE_S:
            return False
        gc.collect()
        self._collected_at = self._clock()
        self.collections += 1
        return True

    def stop(self) -> None:
        """Unfreeze and give Python its thresholds back (the app is closing)."""
        if self._saved is None:
            return
        gc.unfreeze()
        gc.set_threshold(*self._saved)
        self._saved = None
