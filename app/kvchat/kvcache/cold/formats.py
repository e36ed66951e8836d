"""The snapshot file formats: names, headers, checksums, and verifying a mapped file.

File layouts (little-endian)::

    blob:   b"KVCSNAP1" u32 header_len header(JSON) i32 × n_tokens state
    chunk:  b"KVCCHNK1" u32 header_len header(JSON) chunk bytes

Each header repeats its index row; xxh3-128 checksums cover the data. Readers raise
:class:`SnapshotRejected` with the reason a file can't be trusted.

File names derive from keys, never from stored strings: a blob is
``<session id>-<hex stamp>.kvs`` and a chunk ``<key[:2]>/<key>.kvc``. The ``path`` column
of an index row is only compared with the name its key gives (:func:`is_blob_name`,
:func:`chunk_name`); a name that is not one of these patterns is never opened or removed.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import time
from array import array
from typing import Any

import numpy as np
import xxhash

from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.store import ChunkRow, SnapshotRow

MAGIC = b"KVCSNAP1"
CHUNK_MAGIC = b"KVCCHNK1"
SUFFIX = ".kvs"
CHUNK_SUFFIX = ".kvc"


def checksum(*parts: Any) -> str:
    """xxh3-128 of ``parts`` in order, as hex."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def chain_checksum(keys: list[str]) -> str:
    """The checksum a chunked snapshot's row keeps of its chunk list."""
    return checksum(json.dumps(keys).encode())


def token_bytes(tokens: list[int]) -> bytes:
    """Token ids as stored in a blob (and hashed into chunk keys): native i32."""
    return array("i", tokens).tobytes()


# Session ids are ``secrets.token_hex(4)``; a reading of documents shared by conversations
# (kvchat.service.documents) is saved under 24 hex digits of its tokens' hash; chunk keys
# are xxh3-128 hex digests.
SESSION_ID = re.compile(r"[0-9a-f]{8}|[0-9a-f]{24}")
CHUNK_KEY = re.compile(r"[0-9a-f]{32}")
# A blob's name: its session id and a hex stamp (a new name per save, so the old file
# stays whole until the new row is committed).
BLOB_NAME = re.compile(r"(?P<session>[0-9a-f]{8}|[0-9a-f]{24})-[0-9a-f]{1,16}\.kvs")
CHUNK_FILE = re.compile(r"(?P<key>[0-9a-f]{32})\.kvc")
CHUNK_SUBDIR = re.compile(r"[0-9a-f]{2}")
# A temp file of a write in progress: ``<final name>.<pid>.tmp``.
TEMP_NAME = re.compile(r"(?P<final>.+)\.(?P<pid>[0-9]{1,10})\.tmp")


def valid_session_id(session_id: object) -> bool:
    return isinstance(session_id, str) and SESSION_ID.fullmatch(session_id) is not None


def valid_key(key: object) -> bool:
    return isinstance(key, str) and CHUNK_KEY.fullmatch(key) is not None


def blob_name(session_id: str) -> str:
    """A fresh file name for a session's blob (relative to the snapshot directory).

    Raises ValueError for a session id that is not one kvchat makes.
    """
    if not valid_session_id(session_id):
        raise ValueError(f"not a session id: {session_id!r}")
    return f"{session_id}-{time.time_ns():x}{SUFFIX}"


def is_blob_name(session_id: str, name: object) -> bool:
    """Whether ``name`` is a blob name :func:`blob_name` could have given ``session_id``."""
    match = BLOB_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match["session"] == session_id


def chunk_name(key: str) -> str:
    """A chunk's file name (relative to the chunk directory), derived from its key only.

    Raises ValueError for a key that is not a chunk key.
    """
    if not valid_key(key):
        raise ValueError(f"not a chunk key: {key!r}")
    return f"{key[:2]}/{key}{CHUNK_SUFFIX}"


def _preamble(magic: bytes, header: dict[str, Any]) -> bytes:
    encoded = json.dumps(header, sort_keys=True).encode()
    return magic + struct.pack("<I", len(encoded)) + encoded


def blob_parts(
    session_id: str, fingerprint: dict[str, Any], tokens: list[int], state: memoryview
) -> tuple[list[Any], str]:
    """The pieces of a blob file, in order, and the checksum its row records."""
    ids = token_bytes(tokens)
    digest = checksum(ids, state)
    header = {
        "session_id": session_id,
        "fingerprint": fingerprint,
        "n_tokens": len(tokens),
        "n_bytes": len(state),
        "checksum": digest,
    }
    return [_preamble(MAGIC, header), ids, state], digest


def chunk_parts(key: str, start: int, end: int, chunk: np.ndarray) -> tuple[list[Any], str]:
    """The pieces of a chunk file, in order, and the checksum its row records."""
    digest = checksum(chunk)
    return [_chunk_preamble(key, start, end - start, len(chunk), digest), chunk], digest


def _chunk_preamble(key: str, start: int, n_tokens: int, n_bytes: int, digest: str) -> bytes:
    header = {
        "key": key,
        "start": start,
        "n_tokens": n_tokens,
        "n_bytes": n_bytes,
        "checksum": digest,
    }
    return _preamble(CHUNK_MAGIC, header)


def chunk_preamble(entry: ChunkRow) -> bytes:
    """The exact bytes before a chunk's data, as :func:`chunk_parts` wrote them for the
    chunk ``entry`` indexes (a reader that finds them needs no JSON parse)."""
    return _chunk_preamble(entry.key, entry.start, entry.n_tokens, entry.n_bytes, entry.checksum)


def read_header(mapped: mmap.mmap | bytes, magic: bytes, name: str) -> tuple[dict[str, Any], int]:
    """The file's JSON header and the offset of the data after it."""
    if mapped[:8] != magic:
        raise SnapshotRejected(f"{name} is not a kvchat snapshot file (bad magic)")
    (header_len,) = struct.unpack("<I", mapped[8:12])
    if 12 + header_len > len(mapped):
        raise SnapshotRejected(f"snapshot file is truncated ({len(mapped)} bytes)")
    try:
        header = json.loads(mapped[12 : 12 + header_len])
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        raise SnapshotRejected("snapshot header is corrupt") from None
    if not isinstance(header, dict):
        raise SnapshotRejected("snapshot header is not a JSON object")
    return header, 12 + header_len


def read_blob(mapped: mmap.mmap, row: SnapshotRow, name: str) -> np.ndarray:
    """The blob's state bytes (a view into ``mapped``), verified against ``row``."""
    if row.n_tokens < 0 or row.n_bytes < 0 or len(row.token_ids) != row.n_tokens:
        raise SnapshotRejected("snapshot index row is damaged (negative or mismatched sizes)")
    header, tokens_at = read_header(mapped, MAGIC, name)
    state_at = tokens_at + 4 * row.n_tokens
    expected = state_at + row.n_bytes
    if len(mapped) != expected:
        raise SnapshotRejected(
            f"snapshot file is truncated or padded ({len(mapped)} of {expected} bytes)"
        )
    if (
        header.get("n_tokens") != row.n_tokens
        or header.get("n_bytes") != row.n_bytes
        or header.get("checksum") != row.checksum
        or header.get("fingerprint") != row.fingerprint
    ):
        raise SnapshotRejected("snapshot header does not match its index row")
    tokens = mapped[tokens_at:state_at]
    if tokens != token_bytes(row.token_ids):
        raise SnapshotRejected("snapshot token ids do not match its index row")
    state = np.frombuffer(mapped, dtype=np.uint8, count=row.n_bytes, offset=state_at)
    if checksum(tokens, state) != row.checksum:
        del state
        raise SnapshotRejected("snapshot checksum mismatch: the file is corrupt")
    return state


def read_chunk(mapped: mmap.mmap, entry: ChunkRow, start: int, name: str) -> np.ndarray:
    """The chunk's bytes (a view into ``mapped``), verified against ``entry``.

    ``start`` is where the chain places the chunk; it must be where the row says it starts.
    """
    header, data_at = read_header(mapped, CHUNK_MAGIC, name)
    if entry.n_bytes < 0 or len(mapped) != data_at + entry.n_bytes:
        raise SnapshotRejected(f"snapshot chunk {name} is truncated or padded")
    if (
        header.get("key") != entry.key
        or header.get("n_bytes") != entry.n_bytes
        or header.get("checksum") != entry.checksum
        or header.get("start") != entry.start
        or header.get("n_tokens") != entry.n_tokens
        or entry.start != start
    ):
        raise SnapshotRejected(f"snapshot chunk {name} does not match its index row")
    data = np.frombuffer(mapped, dtype=np.uint8, count=entry.n_bytes, offset=data_at)
    if checksum(data) != entry.checksum:
        del data
        raise SnapshotRejected(f"snapshot chunk checksum mismatch: {name} is corrupt")
    return data
