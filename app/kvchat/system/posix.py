"""The POSIX implementation (Linux; macOS for what it shares): the kernel refuses links
(``O_NOFOLLOW``), ``flock`` locks vanish with their process, ``/proc`` says the rest."""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from kvchat.system.api import CpuInfo, Listener, LockBusy, ProcessUsage, unix_clipboard_command

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only: fault the pages in at once
# Buffers one preadv call takes.
IOV_MAX = 1024
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


class _FlockHeld:
    """An ``flock`` held on ``fd``; the holder's note is written into the lock file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def note(self, text: str) -> None:
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode("utf-8"), 0)
        except OSError:
            pass


def _read_note(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _die_with_parent() -> None:
    """In the child, before it runs: a SIGKILL when the thread that started it ends."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def parse_cpuinfo(text: str) -> CpuInfo:
    """Flags, model name and physical cores from ``/proc/cpuinfo``'s text."""
    flags: frozenset[str] = frozenset()
    model = ""
    cores: set[tuple[str, str]] = set()
    phys = core = ""
    for line in [*text.splitlines(), ""]:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key in ("model name", "Model", "Hardware") and not model:
            model = value
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not key and core:
            cores.add((phys, core))
            core = ""
    return CpuInfo(flags=flags, model=model, physical_cores=len(cores))


class PosixSystem:
    """Linux and macOS."""

    name: str = "posix"
    refuses_links_atomically: bool = True
    clipboard_tools: tuple[str, ...] = ("wl-copy", "xclip", "pbcopy")

    def open_no_follow(
        self, path: Path, flags: int, mode: int = 0o600, *, nonblocking: bool = False
    ) -> int:
        extra = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if nonblocking else 0)
        return os.open(path, flags | extra, mode)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def hold_lock(self, path: Path, wait_s: float | None) -> Iterator[_FlockHeld]:
        # flock belongs to the open file: it is released when fd closes or the process dies.
        fd = self.open_no_follow(path, os.O_CREAT | os.O_RDWR)
        try:
            if wait_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                deadline = time.monotonic() + wait_s
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockBusy(_read_note(fd)) from None
                        time.sleep(_POLL_S)
            yield _FlockHeld(fd)
        finally:
            os.close(fd)

    def remove_lock(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def map_read_only(self, fd: int, size: int) -> mmap.mmap:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)

    def read_into(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        done = 0
        for first in range(0, len(buffers), IOV_MAX):
            batch = buffers[first : first + IOV_MAX]
            want = sum(len(b) for b in batch)
            got = os.preadv(fd, batch, offset + done)
            done += got
            if got != want:
                break
        return done

    def pid_alive(self, pid: int) -> bool:
        if pid <= 0:
            return False
        if pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)  # signal 0: existence and permission checked, nothing sent
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # someone else's process
        except (OverflowError, ValueError):
            return False  # too large to be a pid
        return True

    def owned_by_me(self, info: os.stat_result) -> bool:
        return info.st_uid == os.getuid()

    def child_options(self) -> dict[str, Any]:
        if sys.platform.startswith("linux"):
            return {"preexec_fn": _die_with_parent}
        return {}

    def stop_signals(self) -> tuple[signal.Signals, ...]:
        return (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def crash_self(self) -> NoReturn:
        os.kill(os.getpid(), signal.SIGSEGV)
        raise SystemExit(139)  # not reached: SIGSEGV's default action ends the process

    def cpu(self) -> CpuInfo:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                return parse_cpuinfo(fh.read(1 << 22))
        except OSError:
            return CpuInfo()

    def available_ram(self) -> int | None:
        try:
            with open("/proc/meminfo", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def listeners(self, port: int) -> list[Listener]:
        inodes = _listening_inodes(port)
        if not inodes:
            return []
        try:
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        except OSError:
            return []
        found = []
        for pid in pids:
            listener = _listener(pid, inodes)
            if listener is not None:
                found.append(listener)
        return found

    def process_usage(self, pid: int) -> ProcessUsage | None:
        try:
            stat_fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(stat_fields[11]) + int(stat_fields[12])) / os.sysconf("SC_CLK_TCK")
            rss = 0
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return ProcessUsage(cpu, rss)

    def clipboard_command(self, env: Mapping[str, str]) -> tuple[str, ...] | None:
        return unix_clipboard_command(env)


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (IPv4 and IPv6) in this network namespace."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii", errors="replace") as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != _LISTEN:
                        continue
                    _addr, _, hex_port = fields[1].rpartition(":")
                    if hex_port and int(hex_port, 16) == port:
                        inodes.add(fields[9])
        except (OSError, ValueError):
            continue
    return inodes


def _listener(pid: int, inodes: set[str]) -> Listener | None:
    """Process ``pid`` when it holds one of the socket ``inodes`` and is this user's."""
    base = Path("/proc") / str(pid)
    try:
        fds = os.listdir(base / "fd")
        cwd = os.readlink(base / "cwd")
        argv = (base / "cmdline").read_bytes()[: 1 << 20].split(b"\0")
    except OSError:  # another user's process (or gone): not ours to look into
        return None
    targets = set()
    for fd in fds:
        try:
            targets.add(os.readlink(base / "fd" / fd))
        except OSError:  # closed meanwhile
            continue
    if not any(f"socket:[{inode}]" in targets for inode in inodes):
        return None
    return Listener(pid=pid, argv=argv, cwd=cwd)
