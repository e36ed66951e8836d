"""The one interface to what differs between operating systems, and the values it returns.

Every caller in kvchat goes through :func:`kvchat.system.current`; no other module opens a
file with ``O_NOFOLLOW``, takes a lock, signals a process or reads ``/proc`` itself.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

from kvchat.errors import KvchatError


class LockBusy(KvchatError):
    """The lock is held by another process past the wait; ``holder`` is what it noted."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"held by {holder or 'another process'}")
        self.holder = holder


class HeldLock(Protocol):
    """A lock this process holds."""

    def note(self, text: str) -> None:
        """Record who holds it (best effort: a full disk may refuse; the lock still holds)."""


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's feature flags (empty where the OS does not say) and its model name."""

    flags: frozenset[str] = frozenset()
    model: str = ""
    # Distinct (package, core) pairs: physical cores; 0 where the OS does not say.
    physical_cores: int = 0


@dataclass(frozen=True)
class Listener:
    """A process of this user that listens on a TCP port: its command line and folder."""

    pid: int
    argv: list[bytes] = field(default_factory=list)
    cwd: str = ""


@dataclass(frozen=True)
class ProcessUsage:
    """CPU seconds (user + system, all threads) and resident memory of a process."""

    cpu_seconds: float
    rss_bytes: int


class System(Protocol):
    """What kvchat asks of the operating system. Two implementations: ``posix`` (Linux,
    macOS) and ``portable`` (Windows, and any OS without the POSIX calls)."""

    name: str
    # Whether a link in a path's last component is refused by the kernel in the same call
    # that opens it (``O_NOFOLLOW``); when False it is caught by lstat/fstat checks around
    # the open (see ``kvchat.system.portable``).
    refuses_links_atomically: bool
    # The clipboard commands tried, in order, for the one-line hint when none worked.
    clipboard_tools: tuple[str, ...]

    def open_no_follow(
        self, path: Path, flags: int, mode: int = 0o600, *, nonblocking: bool = False
    ) -> int:
        """``os.open(path, flags, mode)`` that never goes through a link in the last
        component (OSError ELOOP), closed on exec; ``flags`` from O_RDONLY, O_WRONLY,
        O_RDWR, O_CREAT, O_EXCL, O_TRUNC, O_APPEND; ``nonblocking``: never wait on a FIFO."""
        ...

    def fsync_dir(self, path: Path) -> None:
        """Make a rename inside directory ``path`` durable (never through a link)."""
        ...

    def hold_lock(self, path: Path, wait_s: float | None) -> AbstractContextManager[HeldLock]:
        """Hold an exclusive lock on ``path`` (created 0600); wait up to ``wait_s`` seconds
        (None: as long as it takes), then raise :class:`LockBusy`."""
        ...

    def remove_lock(self, path: Path) -> None:
        """Delete lock file ``path`` and what the lock keeps beside it (never raises)."""
        ...

    def map_read_only(self, fd: int, size: int) -> mmap.mmap:
        """The first ``size`` bytes of open file ``fd`` mapped read-only."""
        ...

    def read_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset`` of ``fd``; bytes read (short at EOF)."""
        ...

    def pid_alive(self, pid: int) -> bool:
        """Whether process ``pid`` exists (someone else's counts); never signals it."""
        ...

    def owned_by_me(self, info: os.stat_result) -> bool:
        """Whether a file's owner is this user (True where the OS keeps no owner in stat)."""
        ...

    def child_options(self) -> dict[str, Any]:
        """``subprocess.Popen`` options that end the child when kvchat dies, where the OS
        can do that."""
        ...

    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals that ask a long-running kvchat process to stop cleanly."""
        ...

    def crash_self(self) -> NoReturn:
        """Die as a native crash does (a fault-injection hook for the probe's tests)."""
        ...

    def cpu(self) -> CpuInfo:
        """The CPU's flags, model and physical cores, as far as the OS says."""
        ...

    def available_ram(self) -> int | None:
        """The RAM available for new work in bytes, or None where unknown."""
        ...

    def listeners(self, port: int) -> list[Listener]:
        """This user's processes listening on TCP ``port`` on this machine (may be empty
        where the OS does not say)."""
        ...

    def process_usage(self, pid: int) -> ProcessUsage | None:
        """CPU time and resident memory of ``pid``, or None where unknown."""
        ...

    def clipboard_command(self, env: Mapping[str, str]) -> tuple[str, ...] | None:
        """A clipboard command (argv) installed and usable here, or None."""
        ...


def unix_clipboard_command(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """``wl-copy`` needs a Wayland session and ``xclip`` an X display; ``pbcopy`` is macOS's."""
    path = env.get("PATH")
    wl_copy = shutil.which("wl-copy", path=path)
    if wl_copy and env.get("WAYLAND_DISPLAY"):
        return (wl_copy,)
    xclip = shutil.which("xclip", path=path)
    if xclip and env.get("DISPLAY"):
        return (xclip, "-selection", "clipboard")
    pbcopy = shutil.which("pbcopy", path=path)
    if pbcopy:
        return (pbcopy,)
    return None
