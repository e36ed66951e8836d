"""The elements of a JSON array read one at a time from a file: memory holds one element
and a read-ahead of about :data:`CHUNK` bytes, whatever the file's size.

Each element is parsed by Python's own (C) JSON scanner, from a text buffer refilled as it
runs dry: an element cut off at the buffer's end fails to parse, more of the file is read
(at least doubling what is buffered, so a large element costs O(its size)), and it is
parsed again. A parse that fails anywhere but at the buffer's end (or inside a string still
open there) is the file's own error, reported with its line and column in the file.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvchat.transfer.common import BadFile

CHUNK = 1 << 20
# How close to the buffer's end a parse error may be and still mean "cut off here" (a
# truncated literal, number or escape fails a few characters before the end).
_TAIL = 32
_SPACE = re.compile(r"[ \t\n\r]*")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


class ArrayReader:
    """Reads ``[elem, elem, …]`` from a binary file one element at a time.

    :meth:`is_array` says whether the document is an array at all (reading only its first
    bytes); iterating yields the elements. ``bytes_read`` is how far into the file reading
    has got (for progress); ``max_element`` bounds the text one element may take.
    """

    def __init__(self, path: Path, fh: IO[bytes], *, max_element: int, chunk: int = CHUNK):
        self.path = path
        self.fh = fh
        self.chunk = chunk
        self.max_element = max_element
        self.decoder = json.JSONDecoder(parse_constant=_no_constant)
        self.utf8 = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.bytes_read = 0
        self.lines_before = 0  # newlines in the text dropped from the buffer
        self.column_before = 0  # characters after the last of them

    @property
    def bytes_done(self) -> int:
        """About how far into the file parsing has got (read-ahead not counted; characters
        buffered counted as bytes)."""
        return max(0, self.bytes_read - (len(self.buf) - self.pos))

    def _fill(self, at_least: int) -> bool:
        """Read ``at_least`` more bytes (or to the end); False when there were none."""
        if self.eof:
            return False
        data = self.fh.read(max(self.chunk, at_least))
        start = self.bytes_read
        self.bytes_read += len(data)
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise BadFile(
                self.path, f"not UTF-8 text (invalid byte at offset {start + exc.start})"
            ) from None
        if not data:
            self.eof = True
        dropped = self.buf[: self.pos]
        newlines = dropped.count("\n")
        if newlines:
            self.lines_before += newlines
            self.column_before = len(dropped) - dropped.rfind("\n") - 1
        else:
            self.column_before += len(dropped)
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return bool(data)

    def _where(self, index: int) -> str:
        newlines = self.buf.count("\n", 0, index)
        line = self.lines_before + newlines + 1
        if newlines:
            column = index - self.buf.rfind("\n", 0, index)
        else:
            column = self.column_before + index + 1
        return f"line {line}, column {column}"

    def _bad(self, index: int, what: str) -> BadFile:
        return BadFile(self.path, f"not valid JSON ({self._where(index)}: {what})")

    def _skip_space(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill(0):
                return ""

    def is_array(self) -> bool:
        """Whether the document starts with ``[`` (reads only its first bytes)."""
        return self._skip_space() == "["

    def _element(self) -> Any:
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(self.buf) - _TAIL
                if cut and not self.eof:
                    self._more()  # then parse again: the buffer has moved
                    continue
                raise self._bad(exc.pos, exc.msg) from None
            except ValueError as exc:  # NaN, Infinity
                raise BadFile(self.path, f"not valid JSON ({exc})") from None
            except RecursionError:  # the scanner's own guard: no reader walks deeper
                raise BadFile(self.path, "JSON nests too many levels deep: refused") from None
            if end >= len(self.buf) and not self.eof:
                self._more()  # a bare number may go on in the next read
                continue
            self.pos = end
            return value

    def _more(self) -> None:
        """Read more for the element being parsed (nothing more at the end of the file)."""
        held = len(self.buf) - self.pos
        if held > self.max_element:
            raise BadFile(
                self.path, f"one element of its list is over {self.max_element:,} characters"
            )
        self._fill(held)

    def __iter__(self) -> Iterator[Any]:
        if self._skip_space() != "[":
            raise self._bad(self.pos, "expected a list")
        self.pos += 1
        first = True
        while True:
            char = self._skip_space()
            if char == "]" and first:
                break
            if not first:
                if char == "]":
                    break
                if char == "":
                    raise self._bad(self.pos, "the list is cut off")
                if char != ",":
                    raise self._bad(self.pos, "Expecting ',' delimiter")
                self.pos += 1
                char = self._skip_space()
            if char == "":
                raise self._bad(self.pos, "the list is cut off")
            first = False
            yield self._element()
        self.pos += 1
        if self._skip_space() != "":
            raise self._bad(self.pos, "Extra data")
