"""What ``kvchat bench`` says while it runs: an estimate up front and a progress bar.

The estimate is made from the prefill speed measured at the start (tokens/s at 128
tokens) and a plan of steps, each with its expected seconds; the bar advances by those
expectations, so it moves evenly even when one step is long. Both go to stderr only.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

# A prefill of n tokens runs slower per token as n grows (attention over the history):
# measured on SmolLM2-135M, 2 cores, f16 KV: 445 tok/s at 500 tokens, 317 at 4,185, from
# ~480 at 128: time ≈ n / rate × (1 + n / ATTENTION_TOKENS).
ATTENTION_TOKENS = 8192
# Seconds a step costs beyond its prefills (index writes, restores, probes), and a model load.
STEP_OVERHEAD_S = 1.0
LOAD_S = 3.0
BAR_WIDTH = 24


def prefill_seconds(tokens: int, rate: float) -> float:
    """Expected seconds to prefill ``tokens`` at ``rate`` tokens/s (measured at 128 tokens)."""
    if rate <= 0:
        return 0.0
    return tokens / rate * (1 + tokens / ATTENTION_TOKENS)


@dataclass(frozen=True)
class Step:
    key: str
    label: str
    seconds: float


@dataclass(frozen=True)
class BenchPlan:
    """The steps of one run, in order, with their expected seconds."""

    steps: tuple[Step, ...]

    @property
    def seconds(self) -> float:
        return sum(step.seconds for step in self.steps)


def plan_resume_bench(
    sizes: list[int],
    rate: float,
    *,
    repeat: int,
    writes: int,
    forks: int,
    other_layout: bool,
    generate_rate: float = 60.0,
) -> BenchPlan:
    """The default bench's steps: per size two prefills (the snapshot's, the baseline's) and
    ``repeat`` rounds of restores and probes; the writes' turns; the forks; the other layout
    (a model load and one prefill per size)."""
    steps = []
    for size in sizes:
        rounds = repeat * (0.3 + 2 * prefill_seconds(60, rate) + size / 100_000)
        seconds = 2 * prefill_seconds(size, rate) + rounds + STEP_OVERHEAD_S
        steps.append(Step(f"resume-{size}", f"{size:,} tokens: resume vs re-read", seconds))
    if writes:
        # Each turn reads ~130 new tokens and writes a 48-token reply.
        per_turn = prefill_seconds(130, rate) + 48 / generate_rate + 0.3
        steps.append(Step("writes", f"writes: {writes} turns", writes * per_turn))
    if forks:
        seconds = prefill_seconds(2048, rate) + forks * (0.6 + 24 / generate_rate) + 2
        steps.append(Step("forks", f"forks: {forks} branches", seconds))
    if other_layout:
        seconds = LOAD_S + sum(prefill_seconds(s, rate) + repeat * 0.2 + 1 for s in sizes)
        steps.append(Step("layout", "the other V layout", seconds))
    return BenchPlan(tuple(steps))


def clock(seconds: float) -> str:
    """``75.2`` → ``1:15``; ``3725`` → ``1:02:05``."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


def estimate_line(plan: BenchPlan, rate: float) -> str:
    """E.g. "this will take about 1:35 (4 steps; prompts read at 480 tok/s here)"."""
    count = len(plan.steps)
    return (
        f"this will take about {clock(plan.seconds)} ({count} step{'s' * (count != 1)}; "
        f"prompts read at {rate:,.0f} tok/s here)"
    )


def bar_line(fraction: float, elapsed: float, left: float, label: str) -> str:
    """E.g. "[######------------------]  25%  0:20 spent, ~1:00 left  4,096 tokens: …"."""
    fraction = min(1.0, max(0.0, fraction))
    filled = round(fraction * BAR_WIDTH)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    return f"[{bar}] {fraction:>4.0%}  {clock(elapsed)} spent, ~{clock(left)} left  {label}"


@dataclass
class ProgressBar:
    """A bar on ``stream`` advanced by a plan's steps. On a terminal it is redrawn in place
    twice a second (lines said meanwhile are printed above it); elsewhere one line a step."""

    plan: BenchPlan
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    now: Callable[[], float] = time.monotonic
    _done_s: float = 0.0
    _current: Step | None = None
    _step_started: float = 0.0
    _started: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ticker: threading.Thread | None = None

    @property
    def live(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def start(self) -> None:
        self._started = self.now()
        if self.live:
            self._ticker = threading.Thread(target=self._tick, name="bench-progress", daemon=True)
            self._ticker.start()

    def step(self, key: str) -> None:
        """Step ``key`` of the plan starts (the ones before it are done)."""
        with self._lock:
            found = False
            done = 0.0
            for step in self.plan.steps:
                if step.key == key:
                    self._current, found = step, True
                    break
                done += step.seconds
            if not found:
                return
            self._done_s = done
            self._step_started = self.now()
            if not self.live:
                self.stream.write(self.line() + "\n")
                self.stream.flush()
            else:
                self._draw()

    def say(self, text: str) -> None:
        """A line of its own, above the bar."""
        with self._lock:
            if self.live:
                self.stream.write("\r\x1b[2K")
            self.stream.write(text + "\n")
            if self.live:
                self._draw()
            self.stream.flush()

    def fraction(self) -> float:
        total = self.plan.seconds
        if not total or self._current is None:
            return 0.0
        in_step = min(self.now() - self._step_started, self._current.seconds)
        return (self._done_s + in_step) / total

    def line(self) -> str:
        elapsed = self.now() - self._started
        fraction = self.fraction()
        left = max(0.0, self.plan.seconds - self.plan.seconds * fraction)
        label = self._current.label if self._current else ""
        return bar_line(fraction, elapsed, left, label)

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self.line())
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._draw()

    def finish(self) -> float:
        """Stop the bar; the seconds the run took."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self.live:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
        return self.now() - self._started


class Reporter:
    """Where a run's estimate, steps and lines go: nowhere (``--json``), or stderr."""

    def begin(self, plan: BenchPlan, rate: float) -> None:
        """The plan is known: say how long it will take."""

    def step(self, key: str) -> None:
        """Step ``key`` of the plan starts."""

    def say(self, text: str) -> None:
        """A line of what was found."""

    def finish(self) -> None:
        """The run is over."""


@dataclass
class TerminalReporter(Reporter):
    """The estimate as a line, then a :class:`ProgressBar`, on ``stream`` (stderr)."""

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    _bar: ProgressBar | None = None

    def begin(self, plan: BenchPlan, rate: float) -> None:
        self.stream.write(estimate_line(plan, rate) + "\n")
        self._bar = ProgressBar(plan, self.stream)
        self._bar.start()

    def step(self, key: str) -> None:
        if self._bar is not None:
            self._bar.step(key)

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.say(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.finish()
