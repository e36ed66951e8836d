"""One file → one document: read whole, once, and checked.

A file is opened without blocking (a FIFO or a device is refused, never waited on), its size
is checked before a byte is read, and it is read once: if its size or modification time moved
while it was read, or more bytes came than it had at the start, it is refused as changed.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from kvchat.documents.bounds import DEFAULT_BOUNDS, ReadBounds
from kvchat.documents.document import Document, display_name, refuse
from kvchat.documents.formats import extract, kind_of
from kvchat.paths import NotARegularFile, file_kind, open_regular
from kvchat.units import human_bytes

_CHUNK = 1 << 20


def read_document(
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    bounds: ReadBounds = DEFAULT_BOUNDS,
    follow_links: bool = True,
) -> Document:
    """The file at ``path`` as a document called ``name`` (default: its file name), shown
    harmlessly (:func:`~kvchat.documents.document.display_name`)."""
    where = Path(path)
    shown = name if name is not None else where.name or str(where)
    raw = read_bytes(where, shown, bounds.max_file_bytes, follow_links=follow_links)
    kind = kind_of(shown, raw)
    text, pages = extract(shown, kind, raw, bounds)
    return Document(
        name=display_name(shown),
        size=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
        kind=kind,
        text=text,
        pages=pages,
    )


def read_bytes(path: Path, name: str, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them, read once; a
    :class:`~kvchat.errors.DocumentError` naming ``name`` for anything else."""
    try:
        fd, size = open_regular(path, follow_links=follow_links)
    except NotARegularFile as exc:
        raise refuse(name, f"is {file_kind(exc.mode)}, not a file") from None
    except OSError as exc:
        raise refuse(name, open_problem(exc, follow_links=follow_links)) from None
    try:
        if size > limit:
            raise refuse(name, f"is {human_bytes(size)}; the limit is {human_bytes(limit)}")
        before = os.fstat(fd)
        raw = _read_up_to(fd, size + 1, name)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if len(raw) != size or (after.st_size, after.st_mtime_ns) != (
        before.st_size,
        before.st_mtime_ns,
    ):
        raise refuse(
            name,
            f"changed while reading ({size:,} bytes at the start, {len(raw):,} read, "
            f"{after.st_size:,} at the end)",
        )
    return raw


def _read_up_to(fd: int, count: int, name: str) -> bytes:
    chunks: list[bytes] = []
    left = count
    while left > 0:
        try:
            chunk = os.read(fd, min(left, _CHUNK))
        except BlockingIOError:
            raise refuse(name, "would block (not a plain file on disk)") from None
        except OSError as exc:
            raise refuse(name, f"cannot be read ({exc.strerror or exc})") from None
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def open_problem(exc: OSError, *, follow_links: bool = True) -> str:
    """What an OSError from opening or statting a path means, in words."""
    if exc.errno == errno.ENOENT:
        return "no such file or folder"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ELOOP:
        return "is a link (not followed)" if not follow_links else "is a link loop"
    if exc.errno == errno.ENOTDIR:
        return "a part of the path is not a folder"
    if exc.errno == errno.ENAMETOOLONG:
        return "the path is too long"
    return f"cannot be opened ({exc.strerror or exc})"
