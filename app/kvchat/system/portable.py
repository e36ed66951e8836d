"""The portable implementation: Windows, and any OS without the POSIX calls kvchat uses.

Written for Windows, run by the Linux test suite (``KVCHAT_PLATFORM=portable``). What it
guarantees less than :mod:`kvchat.system.posix`:

- Links: no ``O_NOFOLLOW``. The path is lstat-ed before the open and again after it, and
  both must be the opened file (same st_dev and st_ino, not a link), else the descriptor
  is closed and ELOOP raised. So nothing is ever *read* or *written* through a link, but a
  link swapped in between the lstat and the open can still make the open itself reach its
  target: with O_CREAT and no O_EXCL a missing target may be created (empty). O_TRUNC is
  applied only after the checks, so no target is ever truncated.
- Locks: the ``filelock`` package (msvcrt.locking on Windows). The lock is released when
  the process dies, as flock's is; the holder's note goes into a file beside the lock
  (``<lock>.holder``), because Windows forbids reading a locked byte range.
- Directories: not fsync-ed (Windows cannot open a directory with os.open); a rename's
  durability rests on the file system's journal (NTFS).
- Processes: alive-checks use OpenProcess on Windows; nothing ends a child when kvchat
  dies; no CPU flags, cores or listening sockets are read (unknown, not guessed).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import signal
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import filelock

from kvchat.system.api import CpuInfo, Listener, LockBusy, ProcessUsage, unix_clipboard_command

_WINDOWS = os.name == "nt"
# Windows opens files in text mode unless told; never inherited by children there.
_BINARY = getattr(os, "O_BINARY", 0) | getattr(os, "O_NOINHERIT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_HOLDER_SUFFIX = ".holder"
_PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
_STILL_ACTIVE = 259


def _link_error(path: Path) -> OSError:
    return OSError(errno.ELOOP, "is a symbolic link (kvchat does not follow it)", str(path))


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class _FileLockHeld:
    """A ``filelock`` lock held; the note goes into ``<lock>.holder``."""

    def __init__(self, system: PortableSystem, path: Path) -> None:
        self.system = system
        self.path = path.with_name(path.name + _HOLDER_SUFFIX)

    def note(self, text: str) -> None:
        try:
            fd = self.system.open_no_follow(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "wb") as fh:
                fh.write(text.encode("utf-8"))
        except OSError:
            pass


class PortableSystem:
    """Windows, and any OS without ``O_NOFOLLOW``, ``flock`` and ``/proc``."""

    name: str = "portable"
    refuses_links_atomically: bool = False
    clipboard_tools: tuple[str, ...] = ("clip", "pbcopy", "wl-copy", "xclip")

    def open_no_follow(
        self, path: Path, flags: int, mode: int = 0o600, *, nonblocking: bool = False
    ) -> int:
        del nonblocking  # no FIFOs in Windows' file namespace; the fstat below refuses them
        try:
            before: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            before = None
        if before is not None and stat.S_ISLNK(before.st_mode):
            raise _link_error(path)
        fd = os.open(path, (flags & ~os.O_TRUNC) | _BINARY | _CLOEXEC, mode)
        try:
            opened = os.fstat(fd)
            after = os.lstat(path)
            if (
                stat.S_ISLNK(after.st_mode)
                or not _same_file(after, opened)
                or (before is not None and not _same_file(before, opened))
            ):
                raise _link_error(path)
            if flags & os.O_TRUNC and stat.S_ISREG(opened.st_mode):
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def fsync_dir(self, path: Path) -> None:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise _link_error(path)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))

    @contextmanager
    def hold_lock(self, path: Path, wait_s: float | None) -> Iterator[_FileLockHeld]:
        os.close(self.open_no_follow(path, os.O_CREAT | os.O_RDWR))  # 0600, no link
        lock = filelock.FileLock(path, timeout=-1 if wait_s is None else wait_s, mode=0o600)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockBusy(self._holder(path)) from None
        try:
            yield _FileLockHeld(self, path)
        finally:
            lock.release()

    def _holder(self, path: Path) -> str:
        try:
            fd = self.open_no_follow(path.with_name(path.name + _HOLDER_SUFFIX), os.O_RDONLY)
        except OSError:
            return ""
        try:
            return os.read(fd, 200).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        finally:
            os.close(fd)

    def remove_lock(self, path: Path) -> None:
        for victim in (path, path.with_name(path.name + _HOLDER_SUFFIX)):
            try:
                victim.unlink(missing_ok=True)
            except OSError:
                pass

    def map_read_only(self, fd: int, size: int) -> mmap.mmap:
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)

    def read_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        # No preadv/pread on Windows: seek, then read into each buffer (the caller owns fd).
        os.lseek(fd, offset, os.SEEK_SET)
        done = 0
        for buffer in buffers:
            filled = 0
            while filled < len(buffer):
                chunk = os.read(fd, len(buffer) - filled)
                if not chunk:
                    return done + filled
                buffer[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            done += filled
        return done

    def pid_alive(self, pid: int) -> bool:
        if pid <= 0:
            return False
        if pid == os.getpid():
            return True
        if _WINDOWS:
            return _windows_pid_alive(pid)
        # Never os.kill(pid, 0) on Windows (signal 0 is CTRL_C_EVENT there); elsewhere it
        # is the only portable check the standard library has.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        except (OverflowError, ValueError):
            return False
        return True

    def owned_by_me(self, info: os.stat_result) -> bool:
        getuid = getattr(os, "getuid", None)  # Windows keeps no owner in st_uid
        return getuid is None or info.st_uid == getuid()

    def child_options(self) -> dict[str, Any]:
        return {}

    def stop_signals(self) -> tuple[signal.Signals, ...]:
        return (signal.SIGTERM, signal.SIGINT)

    def crash_self(self) -> NoReturn:
        ctypes.string_at(0)  # an access violation (SIGSEGV) on every OS
        raise SystemExit(139)

    def cpu(self) -> CpuInfo:
        import platform

        # Windows names its CPU in the environment; platform.processor() runs uname elsewhere.
        return CpuInfo(model=os.environ.get("PROCESSOR_IDENTIFIER") or platform.machine())

    def available_ram(self) -> int | None:
        if not _WINDOWS:
            return None
        return _windows_available_ram()

    def listeners(self, port: int) -> list[Listener]:
        del port
        return []

    def process_usage(self, pid: int) -> ProcessUsage | None:
        del pid
        return None

    def clipboard_command(self, env: Mapping[str, str]) -> tuple[str, ...] | None:
        path = env.get("PATH")
        clip = shutil.which("clip", path=path) if _WINDOWS else None
        if clip:
            return (clip,)
        return unix_clipboard_command(env)


def _windows_pid_alive(pid: int) -> bool:
    """OpenProcess + GetExitCodeProcess (STILL_ACTIVE): the process exists and runs."""
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined,unused-ignore]
    handle = kernel32.OpenProcess(_PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
    if not handle:
        # error 5, access denied: the process exists (another user's)
        return bool(ctypes.get_last_error() == 5)  # type: ignore[attr-defined,unused-ignore]
    try:
        code = ctypes.c_ulong()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == _STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


class _MemoryStatus(ctypes.Structure):
    _fields_ = [
        ("length", ctypes.c_ulong),
        ("memory_load", ctypes.c_ulong),
        ("total_phys", ctypes.c_ulonglong),
        ("avail_phys", ctypes.c_ulonglong),
        ("total_page_file", ctypes.c_ulonglong),
        ("avail_page_file", ctypes.c_ulonglong),
        ("total_virtual", ctypes.c_ulonglong),
        ("avail_virtual", ctypes.c_ulonglong),
        ("avail_extended_virtual", ctypes.c_ulonglong),
    ]


def _windows_available_ram() -> int | None:
    status = _MemoryStatus()
    status.length = ctypes.sizeof(_MemoryStatus)
    kernel32 = ctypes.WinDLL("kernel32")  # type: ignore[attr-defined,unused-ignore]
    if not kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return None
    return int(status.avail_phys)
