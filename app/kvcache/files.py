"""Private files on disk: atomic writes, read-only mappings, temp names, directory walks.

A file is written to ``<name>.<pid>.tmp`` (created 0600, never over an existing one),
fsynced, renamed over ``<name>``, and then the directory is fsynced, so a crash leaves
the old file or the new one, never a torn one under the final name.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvchat.kvcache.errors import SnapshotRejected

TEMP_SUFFIX = ".tmp"
# Test hook: seconds to stall halfway through writing a snapshot file, so a test can kill
# the process mid-write deterministically.
STALL_ENV = "KVCHAT_FAULT_STALL_SNAPSHOT_WRITE"
# Shortest file that can hold a magic and a header length.
MIN_FILE_BYTES = 12
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) if needed and make it 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(final: Path, parts: list[Any]) -> int:
    """Write ``parts`` to ``final`` via a fsynced temp file and a rename; returns bytes."""
    tmp = final.with_name(f"{final.name}.{os.getpid()}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
        tmp.unlink(missing_ok=True)
        raise
    return written


def temp_writer_alive(name: str) -> bool:
    """Whether temp file ``name`` belongs to another process that is still running."""
    pid_text = name.rsplit(".", 2)[-2]
    return pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def map_file(path: Path, label: str) -> mmap.mmap:
    """The file mapped read-only (MAP_POPULATE: no copy into Python).

    Raises :class:`SnapshotRejected` when it is missing or too short to be ours.
    """
    try:
        fh = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise SnapshotRejected(f"snapshot file is missing: {label}") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < MIN_FILE_BYTES:
            raise SnapshotRejected(f"{path.name} is not a kvchat snapshot file (too short)")
        return mmap.mmap(
            fh.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ
        )


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """:func:`map_file` as a context that unmaps on exit."""
    mapping = map_file(path, str(path))
    try:
        yield mapping
    finally:
        mapping.close()


def walk(directory: Path) -> Iterator[Path]:
    """Every file under ``directory``, depth first."""
    for entry in directory.iterdir():
        if entry.is_dir():
            yield from walk(entry)
        else:
            yield entry
