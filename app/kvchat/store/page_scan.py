"""Reading table rows out of a damaged SQLite file page by page, without SQLite.

What ``sqlite3 .recover`` does, for kvchat's own tables: when SQLite cannot walk a table
(a truncated file, a damaged header or interior page), the rows are still on its leaf
pages. This reads every page of the file (and the newest committed copy of each page in
its WAL), decodes every cell of every table leaf page (following overflow chains), and
hands back the records; :mod:`kvchat.store.integrity` tells which table a record belongs to
by its shape. Nothing here writes, and nothing here trusts a size it reads: every offset
is checked against the page, every chain against loops.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"SQLite format 3\x00"
WAL_MAGIC = (0x377F0682, 0x377F0683)
TABLE_LEAF = 13
PAGE_TYPES = (2, 5, 10, 13)
PAGE_SIZES = tuple(1 << n for n in range(9, 17))


@dataclass
class PageRecord:
    """One row found on a table leaf page."""

    page: int
    rowid: int
    values: list[Any]
    free: bool  # the page is on the freelist: an older copy of the row, if any


@dataclass
class ScanResult:
    records: list[PageRecord] = field(default_factory=list)
    page_size: int = 0
    pages: int = 0  # pages read (the file's whole pages, the WAL's newest)
    leaf_pages: int = 0
    bad_cells: int = 0  # cells that could not be decoded (cut overflow chains, garbage)
    notes: list[str] = field(default_factory=list)


class _Bad(Exception):
    pass


def _varint(data: bytes | memoryview, at: int, end: int) -> tuple[int, int]:
    """SQLite's varint at ``at`` (never past ``end``): (value, next offset)."""
    value = 0
    for i in range(9):
        if at + i >= end:
            raise _Bad("varint past the end")
        byte = data[at + i]
        if i == 8:
            return (value << 8) | byte, at + 9
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, at + i + 1
    raise _Bad("varint")  # unreachable


def _page_size(head: bytes) -> int | None:
    if not head.startswith(MAGIC) or len(head) < 100:
        return None
    (raw,) = struct.unpack_from(">H", head, 16)
    size = 65536 if raw == 1 else raw
    return size if size in PAGE_SIZES else None


def _guess_page_size(data: mmap.mmap | bytes) -> int:
    """The page size under which most pages look like b-tree pages (a damaged header)."""
    best, best_hits = 4096, -1
    for size in PAGE_SIZES:
        hits = 0
        for start in range(size, min(len(data) - size + 1, size * 400), size):
            if data[start] in PAGE_TYPES and _cells_plausible(data, start, 0, size):
                hits += 1
        if hits > best_hits:
            best, best_hits = size, hits
    return best


def _cells_plausible(page: Any, start: int, header_at: int, size: int) -> bool:
    at = start + header_at
    n_cells = struct.unpack_from(">H", page, at + 3)[0]
    content = struct.unpack_from(">H", page, at + 5)[0] or 65536
    return 0 < n_cells < size // 4 and content <= size


def _wal_pages(wal: Path, page_size: int) -> dict[int, bytes]:
    """The newest committed copy of each page in the WAL (frames of its current salts)."""
    try:
        data = wal.read_bytes()
    except OSError:
        return {}
    if len(data) < 32:
        return {}
    magic, _version, size, _seq, salt1, salt2 = struct.unpack_from(">IIIIII", data, 0)
    if magic not in WAL_MAGIC or (size and size != page_size and page_size):
        return {}
    size = size or page_size
    pages: dict[int, bytes] = {}
    pending: dict[int, bytes] = {}
    at = 32
    while at + 24 + size <= len(data):
        number, commit, s1, s2 = struct.unpack_from(">IIII", data, at)
        if (s1, s2) != (salt1, salt2) or number == 0:
            break
        pending[number] = data[at + 24 : at + 24 + size]
        if commit:  # a commit frame: everything so far is committed
            pages.update(pending)
            pending.clear()
        at += 24 + size
    return pages


class _Pages:
    """The file's pages by number (1-based), the WAL's newest committed copies first."""

    def __init__(self, data: Any, size: int, wal: dict[int, bytes]) -> None:
        self.data, self.size, self.wal = data, size, wal
        self.count = max(len(data) // size, max(wal, default=0))

    def get(self, number: int) -> bytes | None:
        if number in self.wal:
            return self.wal[number]
        start = (number - 1) * self.size
        if number < 1 or start + self.size > len(self.data):
            return None
        return bytes(self.data[start : start + self.size])


def _freelist(pages: _Pages, first: bytes | None) -> set[int]:
    """Pages on the freelist (trunks and leaves), as the header names them; loops cut."""
    free: set[int] = set()
    if first is None or not first.startswith(MAGIC):
        return free
    trunk, total = struct.unpack_from(">II", first, 32)
    seen = 0
    while 1 < trunk <= pages.count and trunk not in free and seen <= total + 1:
        page = pages.get(trunk)
        if page is None:
            break
        free.add(trunk)
        next_trunk, n = struct.unpack_from(">II", page, 0)
        n = min(n, (pages.size - 8) // 4)
        free.update(struct.unpack_from(f">{n}I", page, 8))
        seen += n + 1
        trunk = next_trunk
    return free


def _value(kind: int, data: bytes, at: int) -> tuple[Any, int]:
    if kind == 0:
        return None, at
    if 1 <= kind <= 6:
        width = (1, 2, 3, 4, 6, 8)[kind - 1]
        raw = data[at : at + width]
        if len(raw) != width:
            raise _Bad("a value past the record")
        return int.from_bytes(raw, "big", signed=True), at + width
    if kind == 7:
        if at + 8 > len(data):
            raise _Bad("a value past the record")
        return struct.unpack_from(">d", data, at)[0], at + 8
    if kind in (8, 9):
        return kind - 8, at
    if kind >= 12:
        length = (kind - 12) // 2
        raw = data[at : at + length]
        if len(raw) != length:
            raise _Bad("a value past the record")
        if kind % 2:
            try:  # text kvchat wrote is UTF-8: bytes that are not come from a damaged page
                return raw.decode("utf-8"), at + length
            except UnicodeDecodeError:
                raise _Bad("text that is not UTF-8") from None
        return bytes(raw), at + length
    raise _Bad(f"serial type {kind}")


def _record(payload: bytes) -> list[Any]:
    header_size, at = _varint(payload, 0, len(payload))
    if not 0 < header_size <= len(payload):
        raise _Bad("record header size")
    kinds = []
    while at < header_size:
        kind, at = _varint(payload, at, header_size)
        kinds.append(kind)
    values = []
    at = header_size
    for kind in kinds:
        value, at = _value(kind, payload, at)
        values.append(value)
    return values


def _payload(pages: _Pages, page: bytes, at: int, total: int, usable: int) -> bytes:
    """A table leaf cell's payload of ``total`` bytes starting at ``at``, overflow
    followed (SQLite's local/overflow split; a cut or looping chain raises)."""
    most = usable - 35
    if total <= most:
        local = total
    else:
        least = (usable - 12) * 32 // 255 - 23
        local = least + (total - least) % (usable - 4)
        if local > most:
            local = least
    if at + local > len(page):
        raise _Bad("a cell past its page")
    if local == total:
        return page[at : at + total]
    parts = [page[at : at + local]]
    (next_page,) = struct.unpack_from(">I", page, at + local)
    have, seen = local, set()
    while have < total:
        if next_page in seen or not 1 < next_page <= pages.count:
            raise _Bad("an overflow chain is cut")
        seen.add(next_page)
        overflow = pages.get(next_page)
        if overflow is None:
            raise _Bad("an overflow page is missing")
        take = min(total - have, usable - 4)
        parts.append(overflow[4 : 4 + take])
        have += take
        (next_page,) = struct.unpack_from(">I", overflow, 0)
    return b"".join(parts)


def _leaf_cells(pages: _Pages, number: int, page: bytes, usable: int) -> Iterator[Any]:
    """(rowid, values) of each cell of a table leaf page, or _Bad for one that fails."""
    head = 100 if number == 1 else 0
    (n_cells,) = struct.unpack_from(">H", page, head + 3)
    for i in range(min(n_cells, (usable - head - 8) // 2)):
        try:
            (pointer,) = struct.unpack_from(">H", page, head + 8 + 2 * i)
            if not head + 8 <= pointer < usable:
                raise _Bad("a cell pointer off the page")
            total, at = _varint(page, pointer, usable)
            rowid, at = _varint(page, at, usable)
            if total > 1 << 30:
                raise _Bad("a cell of impossible size")
            if rowid >= 1 << 63:
                rowid -= 1 << 64
            yield rowid, _record(_payload(pages, page, at, total, usable))
        except (_Bad, struct.error, IndexError) as exc:
            yield exc


def scan(path: Path, wal: Path | None = None) -> ScanResult:
    """Every record on every table leaf page of ``path`` (and its WAL's committed pages)."""
    result = ScanResult()
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        if size == 0:
            result.notes.append("the file is empty")
            return result
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        page_size = _page_size(bytes(data[:100]))
        if page_size is None:
            page_size = _guess_page_size(data)
            result.notes.append(f"the file's header is damaged: pages read as {page_size} bytes")
        reserved = data[20] if data[:16] == MAGIC and data[20] < 64 else 0
        usable = page_size - reserved
        pages = _Pages(data, page_size, _wal_pages(wal, page_size) if wal else {})
        result.page_size, result.pages = page_size, pages.count
        if len(data) % page_size:
            result.notes.append(f"the file ends inside a page ({len(data):,} bytes)")
        free = _freelist(pages, pages.get(1))
        for number in range(1, pages.count + 1):
            page = pages.get(number)
            if page is None:
                continue
            head = 100 if number == 1 else 0
            if page[head] != TABLE_LEAF:
                continue
            result.leaf_pages += 1
            for cell in _leaf_cells(pages, number, page, usable):
                if isinstance(cell, Exception):
                    result.bad_cells += 1
                    continue
                rowid, values = cell
                result.records.append(PageRecord(number, rowid, values, number in free))
    finally:
        data.close()
    return result
