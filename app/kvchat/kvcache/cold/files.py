"""Private files on disk: atomic writes, read-only mappings, temp names, directory checks.

A file is written to ``<name>.<pid>.tmp`` (created 0600, never over an existing one),
fsynced, renamed over ``<name>``, and then the directory is fsynced, so a crash leaves
the old file or the new one, never a torn one under the final name.

Nothing here follows a symbolic link: a directory is used only when it is a real
directory (:func:`dir_problem`), a file is read only when it is a regular file opened
without following a link (``kvchat.system``), and only regular files are ever removed (:func:`remove_file`).
Existing directories are never chmod-ed; new ones are made 0700 by
:func:`kvchat.paths.ensure_private_dir`.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.paths import ensure_private_dir
from kvchat.system import current as current_system

TEMP_SUFFIX = ".tmp"
# Test hook: seconds to stall halfway through writing a snapshot file, so a test can kill
# the process mid-write deterministically.
STALL_ENV = "KVCHAT_FAULT_STALL_SNAPSHOT_WRITE"
# Shortest file that can hold a magic and a header length.
MIN_FILE_BYTES = 12


def dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a directory kvchat may use (a symlink, a file, missing), or None."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link (kvchat does not follow it)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    return None


def prepare_dir(path: Path) -> str | None:
    """Create ``path`` 0700 when it is missing; why it can't be used, or None when it can.

    An existing directory is used as it is (never chmod-ed); a symlink or a file in its
    place is refused, untouched.
    """
    if os.path.lexists(path):
        return dir_problem(path)
    try:
        ensure_private_dir(path)
    except (OSError, KvchatError) as exc:
        return f"{path} cannot be created ({getattr(exc, 'strerror', None) or exc})"
    return dir_problem(path)


def fsync_dir(path: Path) -> None:
    current_system().fsync_dir(path)


def write_atomically(final: Path, parts: list[Any]) -> int:
    """Write ``parts`` to ``final`` via a fsynced temp file and a rename; returns bytes."""
    tmp = final.with_name(f"{final.name}.{os.getpid()}{TEMP_SUFFIX}")
    fd = current_system().open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    written = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as fh:
            stall = os.environ.get(STALL_ENV)
            for index, part in enumerate(parts):
                view = memoryview(part).cast("B")
                if stall and index == len(parts) - 1:
                    half = len(view) // 2
                    fh.write(view[:half])
                    os.fsync(fh.fileno())
                    time.sleep(float(stall))
                    view = view[half:]
                    written += half
                fh.write(view)
                written += len(view)
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        remove_file(tmp)
        raise
    return written


def temp_writer_alive(name: str) -> bool:
    """Whether temp file ``name`` belongs to another process that is still running."""
    pid_text = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return (
        pid_text.isdigit()
        and int(pid_text) != os.getpid()
        and current_system().pid_alive(int(pid_text))
    )


def regular_file(path: Path) -> os.stat_result | None:
    """``path``'s lstat when it is a regular file (not a symlink, not a directory)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def remove_file(path: Path) -> bool:
    """Unlink ``path`` if it is a regular file (a symlink or a directory is left alone).

    Never raises: a file that is gone or can't be removed stays the caller's non-event.
    """
    if regular_file(path) is None:
        return False
    try:
        path.unlink()
    except OSError:
        return False
    return True


def open_regular(path: Path, label: str) -> tuple[int, int]:
    """``path`` opened read-only without following a link, and its size: ``(fd, size)``;
    the caller closes the fd.

    Raises :class:`SnapshotRejected` when it is missing, not a regular file (a symlink or
    a directory) or too short to be ours.
    """
    try:
        fd = current_system().open_no_follow(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SnapshotRejected(f"snapshot file is missing: {label}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotRejected(f"snapshot file {label} is a symbolic link") from None
        raise SnapshotRejected(
            f"snapshot file {label} cannot be read ({exc.strerror or exc})"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotRejected(f"snapshot file {label} is not a regular file")
        if info.st_size < MIN_FILE_BYTES:
            raise SnapshotRejected(f"{path.name} is not a kvchat snapshot file (too short)")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def map_file(path: Path, label: str) -> mmap.mmap:
    """The file mapped read-only (no copy into Python); raises
    :class:`SnapshotRejected` as :func:`open_regular` does."""
    fd, size = open_regular(path, label)
    try:
        return current_system().map_read_only(fd, size)
    except OSError as exc:
        raise SnapshotRejected(
            f"snapshot file {label} cannot be read ({exc.strerror or exc})"
        ) from None
    finally:
        os.close(fd)


def read_into(fd: int, buffers: list[memoryview], offset: int = 0) -> int:
    """Read the file from ``offset`` straight into ``buffers`` in order; returns the bytes
    read, short at the end of the file."""
    return current_system().read_into(fd, buffers, offset)


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """:func:`map_file` as a context that unmaps on exit."""
    mapping = map_file(path, str(path))
    try:
        yield mapping
    finally:
        mapping.close()


def entries(directory: Path) -> Iterator[os.DirEntry[str]]:
    """The entries of one directory (no recursion, nothing followed); none if unreadable."""
    try:
        with os.scandir(directory) as scan:
            yield from list(scan)
    except OSError:
        return
