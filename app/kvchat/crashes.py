"""Crash logs and run markers: a native crash (a segfault or abort in llama.cpp) or a kill
is never silent.

Neither can be caught in the process it happens to. So each kvchat process that may run the
model writes Python's ``faulthandler`` report into a log of its own in
``<data dir>/crashes``; a process that ends normally removes its (empty) log. A log left
with a report in it is a crash; an empty log whose process is gone is an unclean end (a
``kill -9``, the terminal or the machine gone): the log is the run's marker. The next start
says either once, and ``kvchat doctor`` lists the recent ones. The conversations are safe:
the user's message is committed before the model runs, a streaming reply is stored as it
grows (its last part, of at most ``STREAM_SAVE_EVERY_S``, is what such an end loses) and
shows as cut off, and the input's draft is kept as it is typed.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

from kvchat.system import current as current_system

CRASH_DIR = "crashes"
SEEN_SUFFIX = ".seen"
# Crash logs kept (the oldest are removed when a process starts).
KEEP_LOGS = 20
# Frames that put a crash in the model engine (llama.cpp through llama-cpp-python).
_ENGINE_FRAMES = ("llama_cpp", "kvchat/engine", "kvchat\\engine")

_current: tuple[Path, IO[str]] | None = None


@dataclass(frozen=True)
class CrashReport:
    """A log that a crashed kvchat process left behind."""

    path: Path
    when: float  # the crash's time; for an unclean end, when its run started
    in_engine: bool
    first_line: str
    seen: bool
    killed: bool = False  # no report: the process ended without closing (an unclean end)

    @property
    def when_text(self) -> str:
        return datetime.fromtimestamp(self.when).strftime("%Y-%m-%d %H:%M:%S")

    @property
    def pid(self) -> str:
        return self.path.stem.rsplit("-", 1)[-1]

    def line(self) -> str:
        """One line for the next start, e.g. "the last kvchat run ended in a crash in the
        model engine (llama.cpp) at …; log: …; your conversations are intact"."""
        if self.killed:
            return (
                f"kvchat did not exit cleanly: the run started at {self.when_text} "
                f"(pid {self.pid}) was killed or its machine stopped; a reply it was "
                "writing is kept as far as it was saved, marked “cut off: kvchat ended”, "
                "and what was typed in the app's input is kept (see `kvchat doctor`)"
            )
        where = " in the model engine (llama.cpp)" if self.in_engine else ""
        return (
            f"the last kvchat run ended in a crash{where} at {self.when_text} "
            f"({self.first_line}); log: {self.path}; your conversations are intact "
            "(each message is saved before the model runs; see `kvchat doctor`)"
        )


def crash_dir(directory: Path) -> Path:
    return directory / CRASH_DIR


def start_crash_log(directory: Path) -> Path | None:
    """Write this process's fatal-error report (all threads) to a new log in
    ``directory/crashes``; it is removed when the process exits normally. None when the
    directory cannot be written (then nothing is logged)."""
    global _current
    from kvchat.paths import ensure_private_dir

    if _current is not None:
        return _current[0]
    try:
        logs = ensure_private_dir(crash_dir(directory))
        _prune(logs)
        path = logs / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        handle = os.fdopen(fd, "w", encoding="utf-8")
    except (OSError, ValueError):
        return None
    _current = (path, handle)
    faulthandler.enable(file=handle, all_threads=True)
    atexit.register(_clean_exit)
    return path


def current_crash_log() -> Path | None:
    """This process's crash log, if it keeps one."""
    return _current[0] if _current is not None else None


def _clean_exit() -> None:
    """A normal exit: the log holds no report, so it goes."""
    global _current
    if _current is None:
        return
    path, handle = _current
    _current = None
    try:
        faulthandler.disable()
        handle.close()
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def recent_crashes(directory: Path) -> list[CrashReport]:
    """Logs with a report in them and the empty ones of processes gone (unclean ends),
    newest first (this process's own log and those of kvchats running are not)."""
    logs = crash_dir(directory)
    if not logs.is_dir():
        return []
    own = _current[0] if _current is not None else None
    reports = []
    for path in logs.glob("run-*.log"):
        if path == own or path.is_symlink():
            continue
        try:
            stat = path.stat()
            killed = stat.st_size == 0
            if killed and _alive(path.stem.rsplit("-", 1)[-1]):
                continue  # a kvchat running now
            text = "" if killed else path.read_text(encoding="utf-8", errors="replace")[:20000]
        except OSError:
            continue
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "a crash")
        reports.append(
            CrashReport(
                path=path,
                when=stat.st_mtime,
                in_engine=any(frame in text for frame in _ENGINE_FRAMES),
                first_line="killed: no report" if killed else first[:120],
                seen=path.with_name(path.name + SEEN_SUFFIX).exists(),
                killed=killed,
            )
        )
    return sorted(reports, key=lambda r: r.when, reverse=True)


def unreported_crash(directory: Path) -> CrashReport | None:
    """The newest crash not said yet, marked as said (so the next start is quiet)."""
    fresh = [report for report in recent_crashes(directory) if not report.seen]
    for report in fresh:
        try:
            report.path.with_name(report.path.name + SEEN_SUFFIX).touch(mode=0o600)
        except OSError:
            pass
    return fresh[0] if fresh else None


def _prune(logs: Path) -> None:
    """Keep the newest KEEP_LOGS crash logs and run markers (an empty log of a process gone:
    it was killed outright, SIGKILL, and is an unclean end to report)."""
    found = []
    for path in logs.glob("run-*.log"):
        try:
            stat = path.stat()
        except OSError:
            continue
        found.append((stat.st_mtime, path))
    for _, path in sorted(found, reverse=True)[KEEP_LOGS:]:
        _remove(path)


def _remove(path: Path) -> None:
    for victim in (path, path.with_name(path.name + SEEN_SUFFIX)):
        try:
            victim.unlink()
        except OSError:
            pass


def _alive(pid: str) -> bool:
    return pid.isdigit() and current_system().pid_alive(int(pid))


__all__ = [
    "CrashReport",
    "current_crash_log",
    "recent_crashes",
    "start_crash_log",
    "unreported_crash",
]
