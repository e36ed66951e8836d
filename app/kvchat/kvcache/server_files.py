"""A llama-server's slot directory read from this machine: each slot file's size and checksum
as saved, checked again before the server is asked to restore it.

llama.cpp checks little when it loads a slot file: a file cut short or with a flipped bit
can crash the server, and with it every session of every user on it. So where kvchat can
read the directory (a server started by ``kvchat server start`` here) it never hands the
server a file that differs from what it recorded at the save. Only files named by kvchat
(``kvchat-<hex>-<n>.bin``) are read or deleted, never through a symlink.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvchat.system import current as current_system

_NAME = re.compile(r"kvchat-[0-9a-f]{32}-[01]\.bin")
_CHUNK = 4 << 20


@dataclass(frozen=True)
class FileCheck:
    """A slot file's size and xxh3-64 (hex), as read now."""

    size: int
    checksum: str


class SlotDir:
    """The server's ``--slot-save-path``, readable here."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _open(self, name: str) -> int:
        if not _NAME.fullmatch(name):
            raise FileNotFoundError(errno.ENOENT, "not a kvchat slot file name", name)
        fd = current_system().open_no_follow(self.path / name, os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "not a regular file", name)
        return fd

    def check(self, name: str) -> FileCheck:
        """Size and checksum of ``name``; OSError when it is missing or unreadable."""
        fd = self._open(name)
        try:
            digest = xxhash.xxh3_64()
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            size = 0
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as reader:
                while n := reader.readinto(view):
                    digest.update(view[:n])
                    size += n
            return FileCheck(size, digest.hexdigest())
        finally:
            os.close(fd)

    def problem(self, name: str, size: int, checksum: str) -> str | None:
        """Why ``name`` is not the file that was saved (size ``size``, ``checksum``), or None."""
        try:
            found = self.check(name)
        except OSError as exc:
            return f"its slot file cannot be read ({exc.strerror or exc})"
        if found.size != size:
            return f"its slot file is {found.size:,} bytes, not the {size:,} saved (damaged)"
        if found.checksum != checksum:
            return "its slot file's checksum differs from the one saved (damaged)"
        return None

    def remove(self, name: str) -> bool:
        """Delete ``name`` (a kvchat slot file, not a symlink); whether it was there."""
        if not _NAME.fullmatch(name):
            return False
        target = self.path / name
        try:
            if not stat.S_ISREG(os.lstat(target).st_mode):
                return False
            target.unlink()
        except OSError:
            return False
        return True
