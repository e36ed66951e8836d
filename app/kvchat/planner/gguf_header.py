"""The boundary with GGUF files: their header (metadata and tensor table), read bounded.

A GGUF file may come from anywhere (another app's store, a download, a path the user gave),
so every count it declares is checked against the bytes that are really there before
anything is read or allocated: a 230-byte file that declares 2^40 tensors, key-value pairs
or array items is refused at once, in one line, not after gigabytes. The header is read
with plain reads into a buffer that grows only as far as the parse needs and never past
:data:`MAX_HEADER_BYTES` (no memory map: a file cut while it is read is an error, not a
SIGBUS). Only regular files are opened (``O_NONBLOCK``, then ``fstat``). Nested arrays,
unknown value or tensor types, more than 4 dimensions and tensor data past the end of the
file are refused.

Values come back typed as GGUF stores them (``int``, ``float``, ``bool``, ``str``, lists of
those). Long arrays are not decoded (the planner needs only the vocabulary's length): they
come back as :class:`Skipped` with their item count.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from kvchat.paths import NotARegularFile, open_regular
from kvchat.system import current as current_system

# The header of the largest real models (vocabulary, merges, scores) is ~20 MiB.
MAX_HEADER_BYTES = 256 << 20
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 17
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 50
# Arrays longer than this are counted, not decoded.
MAX_DECODED_NUMBERS = 1 << 16
MAX_DECODED_STRINGS = 1024
# Strings longer than this (an embedded tokenizer.json) are counted, not decoded.
MAX_DECODED_STRING_BYTES = 1 << 20

_SCALARS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_FIRST_READ = 1 << 20


class GGUFHeaderError(ValueError):
    """Why a file's GGUF header is not read: one line."""


@dataclass(frozen=True)
class Skipped:
    """An array or string too long to decode here: what it holds, and how many."""

    kind: str
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    def get(self, key: str) -> Any:
        return self.fields.get(key)

    def count(self, key: str) -> int | None:
        """Items in the array at ``key`` (decoded or not); None when it is no array."""
        value = self.fields.get(key)
        if isinstance(value, Skipped):
            return value.count
        return len(value) if isinstance(value, list) else None


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at ``path``; a
    :class:`GGUFHeaderError` (one line) for anything that is not a sound GGUF header."""
    try:
        fd, size = open_regular(path)
    except NotARegularFile:
        raise GGUFHeaderError("not a regular file") from None
    except OSError as exc:
        raise GGUFHeaderError(f"cannot open it: {exc.strerror or exc}") from None
    try:
        return _Parser(fd, size).parse()
    except OSError as exc:
        raise GGUFHeaderError(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


class _Parser:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.buf = bytearray()
        self.pos = 0
        self.order = "<"

    # ---- bytes

    def _need(self, n: int) -> None:
        end = self.pos + n
        if end <= len(self.buf):
            return
        if end > self.size:
            raise GGUFHeaderError(f"its header runs past the end of the file ({self.size} bytes)")
        if end > MAX_HEADER_BYTES:
            raise GGUFHeaderError(f"its header is larger than {MAX_HEADER_BYTES >> 20} MiB")
        target = min(max(end, 2 * len(self.buf), _FIRST_READ), self.size, MAX_HEADER_BYTES)
        while len(self.buf) < target:
            chunk = bytearray(target - len(self.buf))
            got = current_system().read_into(self.fd, [memoryview(chunk)], len(self.buf))
            del chunk[got:]
            if not chunk:
                raise GGUFHeaderError("the file got shorter while it was read")
            self.buf += chunk

    def _left(self) -> int:
        return self.size - self.pos

    def _unpack(self, fmt: str) -> Any:
        fmt = self.order + fmt
        n = struct.calcsize(fmt)
        self._need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def _u32(self) -> int:
        return int(self._unpack("I"))

    def _u64(self) -> int:
        return int(self._unpack("Q"))

    def _bytes(self, limit: int, what: str) -> bytes:
        n = self._u64()
        if n > limit or n > self._left():
            raise GGUFHeaderError(f"{what} declares {n} bytes, more than the file holds")
        self._need(n)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def _string(self, what: str) -> str | Skipped:
        n = self._u64()
        if n > self._left():
            raise GGUFHeaderError(f"{what} declares {n} bytes, more than the file holds")
        self._need(n)
        start, self.pos = self.pos, self.pos + n
        if n > MAX_DECODED_STRING_BYTES:
            return Skipped("string", n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    # ---- the header

    def parse(self) -> GGUFHeader:
        self._need(4)
        if bytes(self.buf[:4]) != b"GGUF":
            raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        self._need(4)
        little, big = (
            struct.unpack_from("<I", self.buf, 4)[0],
            struct.unpack_from(">I", self.buf, 4)[0],
        )
        if little in (2, 3):
            version = little
        elif big in (2, 3):
            self.order, version = ">", big
        else:
            raise GGUFHeaderError(f"GGUF version {little} is not one kvchat reads (2 or 3)")
        self.pos = 8
        n_tensors, n_kv = self._u64(), self._u64()
        # Each key-value pair takes at least 13 bytes, each tensor entry at least 24.
        if n_kv > MAX_KV or n_kv * 13 > self._left():
            raise GGUFHeaderError(f"it declares {n_kv} metadata entries, more than it can hold")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > self._left():
            raise GGUFHeaderError(f"it declares {n_tensors} tensors, more than it can hold")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            raw_key = self._bytes(MAX_KEY_BYTES, "a metadata key")
            key = raw_key.decode("utf-8", errors="replace")
            fields[key] = self._value(self._u32(), key)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = fields.get("general.alignment", 32)
        if type(alignment) is not int or not 1 <= alignment <= 1 << 20:
            raise GGUFHeaderError(f"general.alignment is {alignment!r}, not a small whole number")
        data_start = -(-self.pos // alignment) * alignment
        tensors = []
        for name, shape, type_name, offset, n_bytes in infos:
            if data_start + offset + n_bytes > self.size:
                raise GGUFHeaderError(f"tensor {name[:60]!r} lies past the end of the file")
            tensors.append(TensorInfo(name, shape, type_name, n_bytes))
        return GGUFHeader(version, fields, tuple(tensors))

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string(key[:60])
        if vtype != _ARRAY:
            raise GGUFHeaderError(f"{key[:60]} has value type {vtype}, which GGUF has not")
        itype, count = self._u32(), self._u64()
        if itype == _ARRAY:
            raise GGUFHeaderError(f"{key[:60]} is an array of arrays")
        if itype in _SCALARS:
            width = struct.calcsize(_SCALARS[itype])
            if count * width > self._left():
                raise GGUFHeaderError(f"{key[:60]} declares {count} items, more than it holds")
            if count > MAX_DECODED_NUMBERS:
                self._need(count * width)
                self.pos += count * width
                return Skipped("number", count)
            fmt = f"{self.order}{count}{_SCALARS[itype]}"
            self._need(count * width)
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += count * width
            return values
        if itype != _STRING:
            raise GGUFHeaderError(f"{key[:60]} holds items of type {itype}, which GGUF has not")
        if count * 8 > self._left():
            raise GGUFHeaderError(f"{key[:60]} declares {count} strings, more than it holds")
        if count > MAX_DECODED_STRINGS:
            self._skip_strings(count, key)
            return Skipped("string", count)
        items = [self._string(key[:60]) for _ in range(count)]
        return [item if isinstance(item, str) else "" for item in items]

    def _skip_strings(self, count: int, key: str) -> None:
        """Past ``count`` strings (a vocabulary: 150k of them), without decoding them."""
        length = struct.Struct(self.order + "Q")
        buf, pos, size = self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > len(buf):
                self.pos = pos
                self._need(8)
            (n,) = length.unpack_from(buf, pos)
            pos += 8
            if n > size - pos:
                raise GGUFHeaderError(f"a string of {key[:60]} runs past the end of the file")
            if pos + n > len(buf):
                self.pos = pos
                self._need(n)
            pos += n
        self.pos = pos

    def _tensor_info(self) -> tuple[str, tuple[int, ...], str, int, int]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self._bytes(MAX_KEY_BYTES, "a tensor name").decode("utf-8", errors="replace")
        n_dims = self._u32()
        if n_dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name[:60]!r} has {n_dims} dimensions (at most 4)")
        shape = tuple(self._u64() for _ in range(n_dims))
        elements = 1
        for dim in shape:
            elements *= dim
            if elements > MAX_ELEMENTS:
                raise GGUFHeaderError(f"tensor {name[:60]!r} is larger than any model's")
        raw_type, offset = self._u32(), self._u64()
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFHeaderError(f"tensor {name[:60]!r} has unknown type {raw_type}") from None
        if shape and shape[0] % block:
            raise GGUFHeaderError(f"tensor {name[:60]!r}: {shape[0]} is no whole {block}-block")
        return name, shape, qtype.name, offset, elements * type_size // block


__all__ = ["GGUFHeader", "GGUFHeaderError", "Skipped", "TensorInfo", "read_header"]
