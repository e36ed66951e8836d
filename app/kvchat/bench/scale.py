"""``kvchat bench --ui --sessions N --messages M``: the app and the CLI as a history grows.

For a home of one conversation (the baseline: as good as empty, with a title for the first
paint to wait for) and for each N, in one run: a home is built through the import path
(``import_file`` of a generated ChatGPT export, :mod:`kvchat.bench.export_gen`, in its own
process: its rate and peak RSS), then measured:

* first paint: process start → the first frame that shows the newest session's title
  (fresh processes, :func:`kvchat.bench.paint.first_paint`), and that process's RSS;
* the app running (model loaded, the store's background integrity check done, nothing
  happening): CPU over ``idle_s`` seconds, read from /proc, its RSS, and keystroke echo
  (key → the frame that shows it in the input);
* search (the service's, as the dialog calls it) for a rare word and for a word in every
  message; ``kvchat list`` (one screen, and --all) in fresh processes.

Every figure is also given against the baseline's, measured in the same run.

Then, in the largest home only (the longest sidebar and the largest search index, the
worst case; each long-session run reads a long prompt and streams a reply), one long
session (:data:`LONG_MESSAGES` messages, through the import path, second in the sidebar)
is added after every figure above is taken, and a second app process measures, against
the bounds of ``kvchat bench --ui``: session switches to and from it (drawn minus the
restore each started), a search jump to a hit in its first message, and keystroke echo
while a reply (temperature 0, a few hundred tokens) streams into it.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.bench.export_gen import (
    COMMON_WORD,
    JUMP_WORD,
    LONG_TITLE,
    RARE_WORD,
    SIZES,
    write_chatgpt_export,
    write_long_export,
)
from kvchat.bench.paint import SIZE, first_paint
from kvchat.bench.ui_report import Switch, _percentile, verdict_lines, verdicts
from kvchat.system import current as current_system

if TYPE_CHECKING:
    from kvchat.config import Settings

Say = Callable[[str], None]
# What the first paint waits for: the newest conversation's title (export_gen names it).
NEWEST_TITLE = "Conversation 0:"
# The home every other is measured against: one conversation (an empty home has no session
# whose title the first paint could wait for).
BASELINE = 1
LIST_SCREEN = 40  # `kvchat list --limit` as one screen
# The long session: its messages, the keys timed while a reply streams into it, and the
# switches timed each way (to it, and from it to the newest session).
LONG_MESSAGES = 5000
LONG_KEYS = 60
LONG_ROUNDS = 2
# The long session's first reply reads a whole context of its history (no KV was ever
# made for an imported session): minutes on a busy CPU.
LONG_READ_S = 900.0


@dataclass
class LongFigures:
    """The long session's figures, in a home of many (see the module docstring)."""

    messages: int = 0  # imported into it
    import_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # the machine's load average: start, end
    to_long: list[Switch] = field(default_factory=list)  # from the newest session to it
    from_long: list[Switch] = field(default_factory=list)  # from it to the newest session
    jump_ms: float = 0.0  # Enter on the hit in its first message → the hit drawn
    jump_mounted: int = 0  # messages mounted after the jump
    jump_number: int | None = None  # the number of the message it landed on (1 asked)
    jump_landed: bool = False  # the message drawn and focused is the hit Enter was on
    echo_ms: list[float] = field(default_factory=list)  # keys timed while a reply streams
    echo_streamed: int = 0  # reply pieces drawn after the first timed key's frame
    error: str | None = None  # the step that failed, and why (figures after it missing)

    @property
    def switches(self) -> list[Switch]:
        return [*self.to_long, *self.from_long]

    @property
    def switch_over_restore_ms(self) -> float | None:
        """The worst switch's time beyond its restore (None: none measured)."""
        return max((s.over_restore_ms for s in self.switches), default=None)

    @property
    def echo_p95_ms(self) -> float | None:
        return _percentile(self.echo_ms, 95) if self.echo_ms else None

    def bounds(self) -> dict[str, dict[str, Any]]:
        return verdicts(
            {
                "switch_over_restore_ms": self.switch_over_restore_ms,
                # A jump that landed elsewhere did not time what was asked.
                "jump_ms": self.jump_ms if self.jump_landed else None,
                "echo_p95_ms": self.echo_p95_ms,
            }
        )

    def to_json(self) -> dict[str, Any]:
        over = self.switch_over_restore_ms
        return {
            "messages": self.messages,
            "import_s": round(self.import_s, 3),
            "load": [round(x, 2) for x in self.load],
            "to_long": [s.to_json() for s in self.to_long],
            "from_long": [s.to_json() for s in self.from_long],
            "switch_over_restore_ms": round(over, 1) if over is not None else None,
            "jump_ms": round(self.jump_ms, 1),
            "jump_mounted": self.jump_mounted,
            "jump_number": self.jump_number,
            "jump_landed": self.jump_landed,
            "echo_keys": len(self.echo_ms),
            "echo_streamed": self.echo_streamed,
            "echo_p50_ms": round(_percentile(self.echo_ms, 50), 1),
            "echo_p95_ms": round(_percentile(self.echo_ms, 95), 1),
            "echo_max_ms": round(max(self.echo_ms, default=0.0), 1),
            "error": self.error,
            "bounds": self.bounds(),
        }


@dataclass
class HomeFigures:
    """One home's figures."""

    sessions: int
    messages: int  # per session
    import_s: float = 0.0
    import_cpu_s: float = 0.0  # the import's own CPU time (a shared machine's load aside)
    imported: int = 0  # messages
    import_peak_rss_mb: float = 0.0
    export_mb: float = 0.0
    first_paint_ms: float = 0.0
    paint_rss_mb: float = 0.0
    ready_s: float = 0.0  # process start → app ready (model loaded)
    idle_cpu: float = 0.0  # share of one core over the idle window
    rss_mb: float = 0.0
    echo_ms: list[float] = field(default_factory=list)
    search_ms: dict[str, float] = field(default_factory=dict)
    search_hits: dict[str, int] = field(default_factory=dict)
    list_ms: float = 0.0
    list_all_ms: float = 0.0
    long: LongFigures | None = None  # the long session's figures (the largest home)

    @property
    def import_rate(self) -> float:
        return self.imported / self.import_s if self.import_s else 0.0

    @property
    def import_cpu_rate(self) -> float:
        return self.imported / self.import_cpu_s if self.import_cpu_s else 0.0

    @property
    def echo_p95_ms(self) -> float:
        return _percentile(self.echo_ms, 95)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("echo_ms")
        data.pop("long")
        data["echo_keys"] = len(self.echo_ms)
        data["echo_p95_ms"] = self.echo_p95_ms
        data["import_rate"] = self.import_rate
        data["import_cpu_rate"] = self.import_cpu_rate
        rounded = _rounded(data)
        if self.long is not None:
            rounded["long_session"] = self.long.to_json()
        return rounded


@dataclass
class ScaleReport:
    idle_s: float
    homes: list[HomeFigures] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    def against_baseline(self, home: HomeFigures) -> dict[str, float]:
        """``home``'s figures against the baseline home's (one conversation): ratios, and
        RSS growth in MB."""
        base = self.homes[0]

        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        return {
            "first_paint_x": ratio(home.first_paint_ms, base.first_paint_ms),
            "paint_rss_x": ratio(home.paint_rss_mb, base.paint_rss_mb),
            "rss_growth_mb": home.rss_mb - base.rss_mb,
            "list_x": ratio(home.list_ms, base.list_ms),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "idle_s": self.idle_s,
            "homes": [
                {**h.to_json(), "against_baseline": _rounded(self.against_baseline(h))}
                for h in self.homes
            ],
        }


def _rounded(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, float):
            out[key] = round(value, 3)
        elif isinstance(value, dict):
            out[key] = _rounded(value)
        else:
            out[key] = value
    return out


# --- building a home through the import path -----------------------------------------------


def _env(home: Path) -> dict[str, str]:
    """The environment of a kvchat process over ``home``: none of this one's KVCHAT_ settings
    but the shared engine-probe file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    if "KVCHAT_PROBE_FILE" in os.environ:
        env["KVCHAT_PROBE_FILE"] = os.environ["KVCHAT_PROBE_FILE"]
    env["KVCHAT_HOME"] = str(home)
    return env


def _kvchat(home: Path, *args: str) -> float:
    """Run ``kvchat ARGS`` over ``home`` (its output dropped): wall seconds."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", *args],
        env=_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"kvchat {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return seconds


def build_home(home: Path, sessions: int, messages: int, scratch: Path) -> HomeFigures:
    """A home of ``sessions`` × ``messages``, made by the import path (``import_file``, as
    ``kvchat import`` calls it, in a process of its own: its time from the file's open to
    the commit, and its peak RSS) from a generated ChatGPT export, removed after."""
    figures = HomeFigures(sessions, messages)
    export = scratch / f"conversations-{sessions}x{messages}.json"
    figures.export_mb = write_chatgpt_export(export, sessions, messages) / 1e6
    done = _import(home, export)
    figures.import_s = done["seconds"]
    figures.import_cpu_s = done["cpu_seconds"]
    figures.imported = done["messages"]
    figures.import_peak_rss_mb = done["rss_kb"] / 1024
    return figures


def _import(home: Path, export: Path) -> dict[str, Any]:
    """Import ``export`` into ``home`` in a process of its own (the file removed after):
    its figures (see :func:`_import_child`)."""
    code = "from kvchat.bench.scale import _import_child; _import_child()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(export)],
            env=_env(home),
            capture_output=True,
            text=True,
            timeout=3600,
        )
    finally:
        export.unlink(missing_ok=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench: the import failed: {proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def add_long_session(
    home: Path, messages: int, scratch: Path, sizes: tuple[int, int] = SIZES
) -> LongFigures:
    """Import one conversation of ``messages`` messages (``sizes`` words a user message /
    a reply) into ``home``, second in its sidebar (see ``export_gen.long_conversation``)."""
    export = scratch / f"long-{messages}.json"
    write_long_export(export, messages, sizes)
    done = _import(home, export)
    return LongFigures(messages=done["messages"], import_s=done["seconds"])


def _import_child() -> None:
    """Run in a fresh process: import the file named on the command line into KVCHAT_HOME
    and print how long it took, how many messages, and the peak RSS."""
    import resource

    from kvchat.config import load_settings
    from kvchat.service.chat import open_service
    from kvchat.transfer import import_file

    with open_service(load_settings()) as service:
        started, cpu = time.perf_counter(), time.process_time()
        result = import_file(service, Path(sys.argv[1]))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    figures = {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "messages": sum(s.messages for s in result.sessions),
        "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    print(json.dumps(figures), flush=True)


# --- measuring -------------------------------------------------------------------------------


def measure_list(home: Path, figures: HomeFigures, runs: int) -> None:
    """``kvchat list`` (one screen) and ``kvchat list --all``, median wall times (the
    run itself interleaves these over its homes)."""
    figures.list_ms = statistics.median(
        _kvchat(home, "list", "--limit", str(LIST_SCREEN)) * 1000 for _ in range(runs)
    )
    figures.list_all_ms = statistics.median(
        _kvchat(home, "list", "--all") * 1000 for _ in range(runs)
    )


def measure_search(settings: Settings, home: Path, figures: HomeFigures, runs: int) -> None:
    """The service's search, as the search dialog calls it: median ms and hits per word."""
    from kvchat.service.chat import ChatService

    service = ChatService(settings, home=home)
    try:
        for name, word in (("rare", RARE_WORD), ("common", COMMON_WORD)):
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                hits = service.sessions.search(word)
                times.append((time.perf_counter() - started) * 1000)
            figures.search_ms[name] = statistics.median(times)
            figures.search_hits[name] = len(hits)
    finally:
        service.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads); 0 where unknown."""
    usage = current_system().process_usage(pid)
    return usage.cpu_seconds if usage else 0.0


def _rss_mb(pid: int) -> float:
    usage = current_system().process_usage(pid)
    return usage.rss_bytes / (1 << 20) if usage else 0.0


def measure_app(home: Path, figures: HomeFigures, idle_s: float, keys: int) -> None:
    """Start the app over ``home`` in its own process, wait until it is ready (model
    loaded), then read its CPU over ``idle_s`` seconds and its RSS, then time ``keys``
    keystrokes' echo."""
    code = "from kvchat.bench.scale import _app_child; _app_child()"
    env = _env(home)
    env["KVCHAT_BENCH_KEYS"] = str(keys)
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("bench --ui: the app process ended before it was ready")
        figures.ready_s = time.perf_counter() - started
        time.sleep(1.0)  # what the app does right after it is ready settles
        cpu, clock = _cpu_seconds(proc.pid), time.perf_counter()
        time.sleep(idle_s)
        figures.idle_cpu = (_cpu_seconds(proc.pid) - cpu) / (time.perf_counter() - clock)
        figures.rss_mb = _rss_mb(proc.pid)
        proc.stdin.write("echo\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if line:
            figures.echo_ms = json.loads(line)["echo_ms"]
    finally:
        proc.kill()
        proc.wait()


def _app_child() -> None:
    """Run in a fresh process: the app over KVCHAT_HOME, driven as the terminal would."""
    from kvchat.bench.ui import _Frames, _press, _wait
    from kvchat.tui.app import KvchatApp

    keys = int(os.environ.get("KVCHAT_BENCH_KEYS", "30"))
    app = KvchatApp(None, cursor_blink=False)

    async def drive() -> None:
        async with app.run_test(size=SIZE):
            await _wait(lambda: app.main.ready, 900)
            loop = asyncio.get_running_loop()
            service = app.service
            if service is not None:  # a big file's integrity check runs after the open
                await loop.run_in_executor(None, service.store.wait_for_check)
            print(json.dumps({"ready": True}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the idle window ends
            frames = _Frames(app)
            prompt = app.main.prompt
            prompt.focus()
            await _wait(lambda: app.focused is prompt)
            latencies = []
            for i in range(keys):
                ch = "abcdefghijklmnopqrstuvwxyz"[i % 26]
                expected = prompt.text + ch
                echoed = frames.when(lambda expected=expected: prompt.text == expected)  # type: ignore[misc]
                pressed = time.perf_counter()
                _press(app, ch, ch)
                at = await asyncio.wait_for(echoed, 30)
                latencies.append((at - pressed) * 1000)
                await asyncio.sleep(0.06)  # a fast typist: ~10 keys a second
            print(json.dumps({"echo_ms": latencies}), flush=True)
            os._exit(0)  # measured: no shutdown to wait for

    asyncio.run(drive())


def measure_long(
    home: Path,
    figures: LongFigures,
    *,
    keys: int = LONG_KEYS,
    rounds: int = LONG_ROUNDS,
    start_s: float | None = None,
    read_s: float = LONG_READ_S,
    n_ctx: int | None = None,
    say: Say | None = None,
) -> None:
    """In an app process of its own over ``home`` (with its long session): switch to the
    long session and back ``rounds`` times, jump to the search hit in its first message,
    then time ``keys`` keys while a reply streams into it (its prompt's read started
    within ``start_s`` seconds, its first piece ``read_s`` after); ``n_ctx``: the
    context's size, else the settings'."""
    from kvchat.bench.ui import REPLY, REPLY_START_S

    load = os.getloadavg()[0]
    code = "from kvchat.bench.scale import _long_child; _long_child()"
    env = _env(home)
    env.update({f"KVCHAT_{name.upper()}": str(value) for name, value in REPLY.items()})
    if n_ctx is not None:
        env["KVCHAT_N_CTX"] = str(n_ctx)
    env["KVCHAT_BENCH_KEYS"] = str(keys)
    env["KVCHAT_BENCH_ROUNDS"] = str(rounds)
    env["KVCHAT_BENCH_START_S"] = str(REPLY_START_S if start_s is None else start_s)
    env["KVCHAT_BENCH_READ_S"] = str(read_s)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    done: dict[str, Any] | None = None
    try:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not one of the child's lines
            if "say" in message and say is not None:
                say(f"scale: long session: {message['say']}")
            if "long" in message:
                done = message["long"]
                break
    finally:
        proc.kill()
        proc.wait()
    figures.load = (load, os.getloadavg()[0])
    if done is None:
        figures.error = f"the app process ended (exit {proc.returncode}) before its figures"
        return
    figures.to_long = [Switch(**s) for s in done["to_long"]]
    figures.from_long = [Switch(**s) for s in done["from_long"]]
    for name in ("jump_ms", "jump_mounted", "jump_number", "echo_ms", "echo_streamed", "error"):
        if name in done:
            setattr(figures, name, done[name])
    figures.jump_landed = bool(done.get("jump_landed"))


def _long_child() -> None:
    """Run in a fresh process: the app over KVCHAT_HOME, the newest session open; switch to
    the long session and back, jump into it, type while a reply streams into it; print the
    figures (and what went wrong, with the figures before it)."""
    from kvchat.bench.ui import REPLY_START_S, _echo, _Frames, _jump, _switch, _wait
    from kvchat.tui.app import KvchatApp

    keys = int(os.environ.get("KVCHAT_BENCH_KEYS", str(LONG_KEYS)))
    rounds = int(os.environ.get("KVCHAT_BENCH_ROUNDS", str(LONG_ROUNDS)))
    start_s = float(os.environ.get("KVCHAT_BENCH_START_S", str(REPLY_START_S)))
    read_s = float(os.environ.get("KVCHAT_BENCH_READ_S", str(LONG_READ_S)))
    app = KvchatApp(None, cursor_blink=False)
    out: dict[str, Any] = {"to_long": [], "from_long": []}

    def say(line: str) -> None:
        print(json.dumps({"say": line}), flush=True)

    async def steps() -> None:
        main = app.main
        frames = _Frames(app)
        await _wait(lambda: main.ready, 900)
        service = app.service
        if service is not None:  # a big file's integrity check runs after the open
            await asyncio.get_running_loop().run_in_executor(None, service.store.wait_for_check)
        await _wait(lambda: main.session_id is not None and main.hot_id == main.session_id)
        rows = main.sessions.rows
        long_id = next(r.id for r in rows if r.summary.session.title.startswith(LONG_TITLE))
        newest_id = next(r.id for r in rows if r.summary.session.title.startswith(NEWEST_TITLE))
        if main.session_id != newest_id:
            await _switch(app, frames, newest_id)
        out["step"] = "switches"
        for i in range(rounds):
            say(f"switch {i + 1} of {rounds} to it and back…")
            out["to_long"].append(asdict(await _switch(app, frames, long_id)))
            out["from_long"].append(asdict(await _switch(app, frames, newest_id)))
        out["step"] = "search jump"
        say("search jump to its first message…")
        jump = await _jump(app, frames, JUMP_WORD)
        out.update(
            jump_ms=jump.ms,
            jump_mounted=jump.mounted,
            jump_number=jump.landed_number,
            jump_landed=jump.landed_id == jump.hit_id and jump.landed_number == 1,
        )
        # Its latest messages again, as a user who goes back to it to write.
        await _switch(app, frames, newest_id)
        await _switch(app, frames, long_id)
        out["step"] = "typing while a reply streams"
        say(f"typing while a reply streams ({keys} keys)…")
        echo = await _echo(app, frames, keys, say, start_s, read_s)
        out.update(echo_ms=echo.ms, echo_streamed=echo.streamed)
        out.pop("step")

    async def drive() -> None:
        async with app.run_test(size=SIZE):
            try:
                await steps()
            except Exception as exc:  # the figures so far, and why the rest are missing
                turn = app.main.turn
                where = ""
                if turn is not None:
                    read = turn.progress
                    where = (
                        f"; the reply had {turn.pieces} pieces, its prompt read"
                        f" {read[0]:,} of {read[1]:,} tokens in {read[2]:.0f} s"
                        if read is not None
                        else f"; the reply had {turn.pieces} pieces, its prompt not yet read"
                    )
                out["error"] = f"{out.get('step', 'start')}: {exc}{where}"
            print(json.dumps({"long": out}), flush=True)
            os._exit(0)  # measured: no shutdown to wait for

    asyncio.run(drive())


# --- the run ---------------------------------------------------------------------------------


def run_scale_bench(
    settings: Settings,
    sessions: list[int],
    messages: int,
    *,
    idle_s: float = 10.0,
    keys: int = 30,
    runs: int = 3,
    app: bool = True,
    long_messages: int = LONG_MESSAGES,
    progress: Say | None = None,
) -> ScaleReport:
    """Measure the baseline home (one conversation) and a home of each size in
    ``sessions`` (× ``messages``); ``app=False`` leaves out the running app (idle CPU,
    RSS, echo: a model load each) and the long session; ``long_messages=0`` leaves out
    only the long session."""
    from kvchat.planner.model_lookup import model_path

    say = progress or (lambda _line: None)
    report = ScaleReport(idle_s=idle_s)
    report.machine = {
        "cpu_cores": os.cpu_count() or 0,
        "load": round(os.getloadavg()[0], 2),
        "model": str(model_path(settings).name),
    }
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-scale-") as scratch:
        root = Path(scratch)
        homes: list[tuple[Path, HomeFigures]] = []
        for n in [BASELINE, *sessions]:
            home = root / f"home-{n}"
            say(f"scale: {n:,} sessions × {messages} messages: importing…")
            figures = build_home(home, n, messages, root)
            say(
                f"scale: imported {figures.imported:,} messages in {figures.import_s:.1f} s"
                f" ({figures.import_rate:,.0f}/s; {figures.import_cpu_rate:,.0f}/s of CPU time;"
                f" peak RSS {figures.import_peak_rss_mb:.0f} MB)"
            )
            homes.append((home, figures))
        # Each run measures every home in turn, so a change of the machine's load meets
        # them all alike and the ratios to the baseline hold.
        paints: dict[int, list[dict[str, float]]] = {id(f): [] for _, f in homes}
        lists: dict[int, list[float]] = {id(f): [] for _, f in homes}
        alls: dict[int, list[float]] = {id(f): [] for _, f in homes}
        for run in range(runs):
            say(f"scale: first paint and kvchat list, run {run + 1} of {runs}…")
            for home, figures in homes:
                paints[id(figures)].append(first_paint(home, 1, shows=NEWEST_TITLE))
                lists[id(figures)].append(_kvchat(home, "list", "--limit", str(LIST_SCREEN)))
                alls[id(figures)].append(_kvchat(home, "list", "--all"))
        for home, figures in homes:
            figures.first_paint_ms = statistics.median(p["total_ms"] for p in paints[id(figures)])
            figures.paint_rss_mb = statistics.median(p["rss_mb"] for p in paints[id(figures)])
            figures.list_ms = statistics.median(lists[id(figures)]) * 1000
            figures.list_all_ms = statistics.median(alls[id(figures)]) * 1000
            say(
                f"scale: {figures.sessions:,} sessions: first paint"
                f" {figures.first_paint_ms:,.0f} ms, kvchat list {figures.list_ms:,.0f} ms"
            )
            measure_search(settings, home, figures, max(runs, 5))
            if app:
                measure_app(home, figures, idle_s, keys)
                say(
                    f"scale: {figures.sessions:,} sessions: idle CPU {figures.idle_cpu:.1%} of"
                    f" a core, RSS {figures.rss_mb:.0f} MB, echo p95 {figures.echo_p95_ms:.0f} ms"
                )
            report.homes.append(figures)
        if app and long_messages and len(homes) > 1:
            # After every other figure: nothing above met the long session.
            home, figures = max(homes, key=lambda pair: pair[1].sessions)
            say(f"scale: {figures.sessions:,} sessions: a {long_messages:,}-message session…")
            figures.long = add_long_session(home, long_messages, root)
            measure_long(home, figures.long, say=say)
            long_bounds = figures.long.bounds()
            say(
                "scale: long session: "
                + ", ".join(
                    f"{name} {b['measured'] if b['measured'] is not None else 'n/a'}"
                    for name, b in long_bounds.items()
                )
            )
    return report


def format_scale_report(report: ScaleReport) -> str:
    machine = report.machine
    lines = [
        f"{machine.get('cpu_cores')} cores, load {machine.get('load')} at the start;"
        f" model {machine.get('model')}",
        "",
        f"{'sessions':>9} {'messages':>9} {'import/s':>9} {'(CPU)':>8} {'imp RSS':>8} {'paint':>8}"
        f" {'×base':>7} {'paintRSS':>9} {'idle CPU':>9} {'RSS':>7} {'+RSS':>6}"
        f" {'echo p95':>9} {'search':>13} {'list':>7} {'list all':>9}",
    ]
    for h in report.homes:
        vs = report.against_baseline(h)
        search = f"{h.search_ms.get('rare', 0):.0f}/{h.search_ms.get('common', 0):.0f} ms"
        lines.append(
            f"{h.sessions:>9,} {h.sessions * h.messages:>9,}"
            f" {h.import_rate:>9,.0f} {h.import_cpu_rate:>8,.0f} {h.import_peak_rss_mb:>6.0f}MB"
            f" {h.first_paint_ms:>6,.0f}ms {vs['first_paint_x']:>6.2f}×"
            f" {h.paint_rss_mb:>7.0f}MB {h.idle_cpu:>9.1%} {h.rss_mb:>5.0f}MB"
            f" {vs['rss_growth_mb']:>+5.0f}"
            f" {h.echo_p95_ms:>7.0f}ms {search:>13} {h.list_ms:>5.0f}ms {h.list_all_ms:>7.0f}ms"
        )
    lines += [
        "",
        "import/s: messages a second imported (CPU: per second of the import's own CPU time);"
        " paint: process start → the newest session's title drawn (median of runs);"
        " paintRSS: that process's peak RSS (no model); idle CPU, RSS, echo: the app running"
        f" with its model, over {report.idle_s:.0f} s; search: a rare word / a word in every"
        f" message; list: `kvchat list --limit {LIST_SCREEN}` / `--all`.",
    ]
    for h in report.homes:
        if h.long is not None:
            lines += ["", f"In the {h.sessions:,}-session home:", *format_long(h.long)]
    return "\n".join(lines)


def format_long(long: LongFigures) -> list[str]:
    """The long session's figures as lines, each bound's verdict last."""
    data = long.to_json()
    lines = [
        f"a session of {long.messages:,} messages (imported in {long.import_s:.1f} s;"
        f" load {long.load[0]:.1f} → {long.load[1]:.1f}):"
    ]
    for name, switches in (("to it", long.to_long), ("from it", long.from_long)):
        for s in switches:
            lines.append(
                f"  switch {name:<7}: drawn {s.drawn_ms:6,.0f} ms · restore {s.source}"
                f" {s.restore_ms:,.1f} ms (drawn − restore {s.over_restore_ms:+,.0f} ms)"
                f" · KV ready {s.ready_ms:,.0f} ms"
            )
    if long.jump_number is not None:
        landed = "the hit" if long.jump_landed else "NOT the hit"
        lines.append(
            f"  search jump to message #1: {long.jump_ms:,.0f} ms, landed on"
            f" #{long.jump_number} ({landed}), {long.jump_mounted} messages mounted"
        )
    if long.echo_ms:
        lines.append(
            f"  keystroke echo while a reply streams into it: p50 {data['echo_p50_ms']:,.0f} ms,"
            f" p95 {data['echo_p95_ms']:,.0f} ms, max {data['echo_max_ms']:,.0f} ms"
            f" ({data['echo_keys']} keys, {long.echo_streamed} reply pieces drawn meanwhile)"
        )
    if long.error:
        lines.append(f"  failed at {long.error}")
    return [*lines, *verdict_lines(data["bounds"])]
