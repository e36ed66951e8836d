"""The boundary with other apps' model stores: files kvchat reads but did not write.

Everything :mod:`kvchat.planner.stores` takes from a store goes through here, so that one
hostile entry costs one line and never the listing:

- a path is used only if it stays inside the store's root once links are resolved (the
  Hugging Face cache links ``snapshots/REV/FILE`` to ``../../blobs/HASH``: inside, fine; a link
  to ``/etc`` or another user's folder is not followed);
- a file is opened only if it is a regular file (``os.stat`` first, then ``O_NONBLOCK`` and
  ``fstat`` on what was opened: a FIFO or a device never blocks or streams);
- a read takes at most a given number of bytes;
- JSON is parsed only below a nesting depth, checked before ``json`` recurses.

Every refusal is a :class:`StoreFileError` whose message is one line for the listing.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from kvchat.paths import NotARegularFile, file_kind, open_regular

# Ollama manifests are a few hundred bytes; anything this large is not one.
MAX_JSON_BYTES = 256 * 1024
# Nesting a manifest needs: {"layers": [{...}]} is 3 deep.
MAX_JSON_DEPTH = 32
# Bytes a store's file may be asked for at most in one read (the GGUF magic is 4).
MAX_READ_BYTES = 1 << 20

_TOKEN = re.compile(rb'["\[\]{}]')
_IN_STRING = re.compile(rb'["\\]')


class StoreFileError(Exception):
    """Why a store's file is not used: one line, shown in the listing."""


def inside(path: Path, root: Path) -> Path:
    """``path`` with its links resolved, when that is inside ``root`` (resolved too); a
    path that leaves the root, or a link loop, is a :class:`StoreFileError`."""
    base = root.resolve()
    try:
        real = path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a link loop
        raise StoreFileError(f"{path.name}: its link cannot be resolved ({exc})") from None
    if real != base and not real.is_relative_to(base):
        raise StoreFileError(f"{path.name} links outside the store (to {real}): not followed")
    return real


def regular_size(path: Path, root: Path) -> int:
    """The size of ``path``, a regular file inside ``root`` (links resolved); else why not."""
    real = inside(path, root)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if path.is_symlink():
            raise StoreFileError(f"{path.name} is a broken link (its target is missing)") from None
        raise StoreFileError(f"{path.name} is not there") from None
    except OSError as exc:
        raise StoreFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreFileError(f"{path.name} is not a regular file ({file_kind(st.st_mode)})")
    return st.st_size


def read_capped(path: Path, root: Path, limit: int = MAX_READ_BYTES) -> bytes:
    """At most ``limit`` bytes of ``path`` (a regular file inside ``root``); a file larger
    than ``limit`` is refused, not cut."""
    real = inside(path, root)
    size = regular_size(path, root)
    if size > limit:
        raise StoreFileError(f"{path.name} is {size} bytes, more than the {limit} read here")
    return _read(real, path.name, limit, exact=True)


def read_head(path: Path, root: Path, count: int) -> bytes:
    """The first ``count`` bytes (fewer if the file is shorter) of a regular file inside
    ``root``."""
    real = inside(path, root)
    regular_size(path, root)
    return _read(real, path.name, min(count, MAX_READ_BYTES), exact=False)


def _read(real: Path, name: str, limit: int, exact: bool) -> bytes:
    try:
        fd, _ = open_regular(real)
    except NotARegularFile as exc:  # swapped between the stat and the open
        raise StoreFileError(f"{name} is not a regular file ({file_kind(exc.mode)})") from None
    except OSError as exc:
        raise StoreFileError(f"cannot read {name}: {exc.strerror or exc}") from None
    try:
        chunks, left = [], limit + 1 if exact else limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise StoreFileError(f"cannot read {name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if exact and len(data) > limit:
        raise StoreFileError(f"{name} grew past the {limit} bytes read here")
    return data


def json_depth(raw: bytes) -> int:
    """How deeply ``raw``'s arrays and objects nest (strings skipped): one pass, no
    recursion and no backtracking, whatever the bytes."""
    depth = deepest = at = 0
    while (token := _TOKEN.search(raw, at)) is not None:
        at = token.end()
        if token.group() == b'"':
            while (inner := _IN_STRING.search(raw, at)) is not None:
                at = inner.end()
                if inner.group() == b'"':
                    break
                at += 1  # the escaped character
            else:
                return deepest  # an unterminated string: json refuses the rest
        elif token.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def load_json(path: Path, root: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A small JSON file of a store, bounded in bytes and nesting; else why not."""
    raw = read_capped(path, root, limit)
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise StoreFileError(f"{path.name} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise StoreFileError(f"{path.name} is not JSON ({str(exc)[:80]})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "StoreFileError",
    "inside",
    "json_depth",
    "load_json",
    "read_capped",
    "read_head",
    "regular_size",
]
