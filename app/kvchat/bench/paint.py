"""``kvchat bench --ui``'s first paint: a fresh process per run, timed to its first frame.

Nothing heavy is imported with this module: the child process imports the app itself.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZE = (120, 36)


def _paint_child(started: float) -> None:
    """Run in a fresh process (started at ``started``, perf_counter): import and start the
    app, print when its first frame is drawn, then leave at once (the model never loads)."""
    from kvchat.tui.app import KvchatApp

    imported = time.perf_counter()
    settings = None
    if os.environ.get("KVCHAT_BENCH_PAINT") == "command":
        from kvchat.config import load_settings

        settings = load_settings()

    shows = os.environ.get("KVCHAT_BENCH_PAINT_SHOWS")

    class FirstFrame(KvchatApp):
        def _display(self, screen: Any, renderable: Any) -> None:
            super()._display(screen, renderable)
            if renderable is not None and not self._batch_count:
                now = time.perf_counter()
                if shows and shows not in _frame_text(self, renderable):
                    return  # not yet the frame that shows what was asked for
                figures = {
                    "wall": time.time(),
                    "import_ms": (imported - started) * 1000,
                    "app_ms": (now - self.created_at) * 1000,
                    "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                }
                print(json.dumps(figures), flush=True)
                os._exit(0)  # the measurement is done: no model, no shutdown

    FirstFrame(settings, cursor_blink=False).run(headless=True, size=SIZE)


def _frame_text(app: Any, renderable: Any) -> str:
    """The characters a frame update draws (the parts of the screen it changes)."""
    return "".join(s.text for s in app.console.render(renderable) if not s.control)


def _compile_package() -> None:
    """Compile kvchat's modules to bytecode first, as pip does when it installs the wheel
    (and Python on a first run): a checkout run with PYTHONDONTWRITEBYTECODE=1 otherwise
    compiles them from source in every process, ~60-100 ms of the first paint here that no
    installed copy pays. An install that cannot be written to is left as it is."""
    import compileall

    import kvchat

    try:
        compileall.compile_dir(Path(kvchat.__file__).parent, quiet=2)
    except OSError:
        pass


def first_paint(
    home: Path, runs: int, mode: str = "app", *, shows: str | None = None
) -> dict[str, float]:
    """Median figures of ``runs`` fresh processes that start the app over ``home``'s
    database (copied: the child is killed at its first frame, or with ``shows`` at the
    first frame that draws that text: the newest session's title in the sidebar)."""
    _compile_package()
    totals, imports, apps, rss = [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="kvchat-paint-") as scratch:
            if (home / "kvchat.db").exists():
                shutil.copy(home / "kvchat.db", Path(scratch) / "kvchat.db")
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
            env.update(KVCHAT_HOME=scratch, KVCHAT_BENCH_PAINT=mode)
            if shows:
                env["KVCHAT_BENCH_PAINT_SHOWS"] = shows
            # The command mode imports what `kvchat` imports before the app (the CLI) first.
            cli = "import kvchat.cli; " if mode == "command" else ""
            code = (
                f"import time; t = time.perf_counter(); {cli}"
                "from kvchat.bench.paint import _paint_child; _paint_child(t)"
            )
            started = time.time()
            proc = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
            )
            lines = proc.stdout.strip().splitlines()
            if not lines:
                raise RuntimeError(f"the first-paint run failed: {proc.stderr[-2000:]}")
            figures = json.loads(lines[-1])
        totals.append((figures["wall"] - started) * 1000)
        imports.append(figures["import_ms"])
        apps.append(figures["app_ms"])
        rss.append(figures["rss_kb"] / 1024)
    return {
        "total_ms": statistics.median(totals),
        "import_ms": statistics.median(imports),
        "app_ms": statistics.median(apps),
        "rss_mb": statistics.median(rss),
    }
