"""``kvchat server start``: run llama-server and start it again when it dies.

A damaged slot file, a bug or the OOM killer can take llama-server down, and with it every
session of every user on it. The supervisor restarts it with a growing pause (reset once a
run has lasted a while), and says in its log why it died and, when it died restoring a slot
file, which one: the slot directory is watched with inotify (Linux) for the last file read,
and the server's last output says whether it died loading one (llama.cpp's assertion and
backtrace name ``state_seq_load_file``). While it runs, the supervisor registers the
server's slot directory (:mod:`kvchat.engine.server_registry`) so that kvchat on this
machine checks slot files before they are restored.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO

from kvchat.engine.server_registry import LocalServer, register, unregister
from kvchat.system import current as current_system

# Pauses before each restart in a row, in seconds (the last one repeats).
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# A run that lasted this long resets the pause to the first one.
HEALTHY_AFTER_S = 60.0

_IN_OPEN = 0x20
_IN_CLOSE_WRITE = 0x08
_IN_CLOSE_NOWRITE = 0x10
_EVENT = struct.Struct("iIII")
# What llama.cpp prints when it dies loading a sequence state (its assertions, backtrace).
_RESTORE_MARKS = ("state_seq_load_file", "state_read", "nread <= state_size", "slot_restore")
# Lines of the server's output kept to tell why it died.
_TAIL_LINES = 400
# Lines the server prints when it has answered a request: what it printed after the last of
# them is what it was doing when it died.
_ANSWERED = ("send_error", "stop processing", "print_timing")


class SlotWatcher:
    """Which files in the slot directory llama-server has open (inotify; Linux only).

    Closes are applied only while the server is still alive after they were read: the
    kernel closes a dead process's files too, and those closes must not hide the file it
    died with."""

    def __init__(self, directory: Path) -> None:
        self.open: dict[str, int] = {}
        # The slot file last opened for reading, or None.
        self.last_read: str | None = None
        self._fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                return
            mask = _IN_OPEN | _IN_CLOSE_WRITE | _IN_CLOSE_NOWRITE
            if libc.inotify_add_watch(fd, bytes(directory), mask) < 0:
                os.close(fd)
                return
            self._fd = fd
        except (OSError, AttributeError):
            self._fd = -1

    def fileno(self) -> int:
        return self._fd

    def drain(self, alive: Callable[[], bool]) -> None:
        """Read the queued events; closes count only if ``alive()`` after reading them."""
        if self._fd < 0:
            return
        events: list[tuple[int, str]] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                return
            if not data:
                break
            at = 0
            while at + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                raw = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
                events.append((mask, raw.decode("utf-8", "replace")))
                at += _EVENT.size + length
        still = alive()
        for mask, name in events:
            if mask & _IN_CLOSE_NOWRITE:
                self.last_read = name
            if mask & _IN_OPEN:
                self.open[name] = self.open.get(name, 0) + 1
            elif still and mask & (_IN_CLOSE_WRITE | _IN_CLOSE_NOWRITE):
                left = self.open.get(name, 0) - 1
                if left > 0:
                    self.open[name] = left
                else:
                    self.open.pop(name, None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Supervisor:
    """Runs ``argv`` (a llama-server) until told to stop, restarting it when it dies."""

    def __init__(
        self,
        argv: Sequence[str],
        entry: LocalServer,
        *,
        say: Callable[[str], None],
        backoff: Sequence[float] = BACKOFF_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
    ) -> None:
        self.argv = list(argv)
        self.entry = entry
        self.say = say
        self.backoff = tuple(backoff) or (1.0,)
        self.healthy_after_s = healthy_after_s
        self.restarts = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def stop(self, *_args: object) -> None:
        """Stop the server and the supervisor (from a signal handler or another thread)."""
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def run(self) -> int:
        """Supervise until stopped; returns the server's last exit status (0 when stopped)."""
        for sig in current_system().stop_signals():
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup keeps ignoring SIGHUP
                signal.signal(sig, self.stop)
        slot_dir = Path(self.entry.slot_dir)
        in_a_row = 0
        status = 0
        try:
            while not self._stop.is_set():
                watcher = SlotWatcher(slot_dir)
                started = time.monotonic()
                self._tail.clear()
                proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                self._proc = proc
                copier = threading.Thread(target=self._copy, args=(proc.stdout,), daemon=True)
                copier.start()
                register(replace(self.entry, server_pid=proc.pid))
                self.say(f"kvchat: llama-server started (pid {proc.pid})")
                try:
                    status = self._wait(proc, watcher)
                finally:
                    watcher.close()
                copier.join(timeout=10)
                if self._stop.is_set():
                    status = 0
                    break
                lasted = time.monotonic() - started
                in_a_row = 1 if lasted >= self.healthy_after_s else in_a_row + 1
                pause = self.backoff[min(in_a_row, len(self.backoff)) - 1]
                self.restarts += 1
                self.say(
                    f"kvchat: llama-server (pid {proc.pid}) {_exit_reason(status)} after "
                    f"{lasted:.0f} s{self._culprit(watcher)}; restart {self.restarts} "
                    f"in {pause:g} s"
                )
                self._stop.wait(pause)
        finally:
            unregister(self.entry)
            last = self._proc
            if last is not None and last.poll() is None:
                last.terminate()
                try:
                    last.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    last.kill()
                    last.wait()
        return status

    def _copy(self, stream: IO[bytes] | None) -> None:
        """Pass the server's output on to ours, keeping its last lines."""
        if stream is None:
            return
        out = sys.stderr
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            self._tail.append(line)
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    def _culprit(self, watcher: SlotWatcher) -> str:
        """`` while restoring slot file X`` when the server died loading one, or ''."""
        last_words: list[str] = []
        for line in reversed(self._tail):
            if any(mark in line for mark in _ANSWERED):
                break
            last_words.append(line)
        loading = any(mark in line for line in last_words for mark in _RESTORE_MARKS)
        files = sorted(watcher.open)
        if not files and loading and watcher.last_read:
            files = [watcher.last_read]
        if not files:
            return ""
        what = "restoring" if loading else "restoring or saving"
        return f" while {what} slot file {', '.join(files)}"

    def _wait(self, proc: subprocess.Popen[bytes], watcher: SlotWatcher) -> int:
        """Wait for ``proc`` to exit, following which slot files it has open meanwhile."""
        alive = lambda: proc.poll() is None  # noqa: E731
        while True:
            if watcher.fileno() >= 0:
                try:
                    select.select([watcher], [], [], 0.2)
                except (OSError, ValueError):
                    time.sleep(0.2)
            else:
                time.sleep(0.2)
            watcher.drain(alive)
            status = proc.poll()
            if status is not None:
                watcher.drain(lambda: False)
                return status


def _exit_reason(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"died ({name})"
    return f"exited with status {status}"
