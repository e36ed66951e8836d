"""Chunk planning: where a chain of chunks is cut, what each chunk's key is, and checking
that a stored chain is the one its row's tokens give.

A chunk's key hashes the fingerprint, every token id up to the chunk's end, and the
chunk's start, so any prefix that sessions, forks and regenerations share gets the same
keys and is stored once, while a chunk cut elsewhere (another start, same end) never
shares a key with it. Cuts already stored for a prefix are kept (a turn only appends
chunks); after them, chunks end on multiples of ``chunk_tokens``, plus a trailing
partial one.

A row is trusted only if its chunk keys re-derive from its own token ids and fingerprint
(:func:`verify_chain`): a row whose keys were swapped for another session's, or written
under an older key scheme, is rejected, never loaded.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import xxhash

from kvchat.engine import common_prefix
from kvchat.kvcache.cold.formats import chunk_name, token_bytes, valid_key
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.store import ChunkRow, SnapshotRow, Store

CHUNK_TOKENS = 256
# A shared prefix shorter than this is not worth borrowing from another session.
MIN_DONOR_TOKENS = 32
KEYS_MISMATCH = "the snapshot's chunk keys do not match its tokens"


def chain_keys(fingerprint: dict[str, Any], tokens: list[int], ends: list[int]) -> list[str]:
    """The key of each chunk [previous end, end) of ``tokens``, for increasing ``ends``.

    A key is xxh3-128 of the fingerprint (canonical JSON), the token ids [0, end) and the
    chunk's start.
    """
    h = xxhash.xxh3_128(json.dumps(fingerprint, sort_keys=True).encode())
    ids = token_bytes(tokens)
    keys = []
    start = 0
    for end in ends:
        h.update(ids[start * 4 : end * 4])
        key = h.copy()
        key.update(b"start" + struct.pack("<q", start))
        keys.append(key.hexdigest())
        start = end
    return keys


def window_key(fingerprint: dict[str, Any], tokens: list[int], start: int, end: int) -> str:
    """The key of a piece of a sliding-window model's window cells, positions [start, end):
    xxh3-128 of the fingerprint, the token ids [0, end) and the start, marked apart from
    chunk keys (a cell's KV depends on the tokens up to it, so pieces of one prefix are
    shared by every session and checkpoint that has it)."""
    h = xxhash.xxh3_128(json.dumps(fingerprint, sort_keys=True).encode())
    h.update(token_bytes(tokens)[: end * 4])
    h.update(b"window" + struct.pack("<q", start))
    return h.hexdigest()


def chunk_plan(
    fingerprint: Fingerprint, tokens: list[int], base: list[int], chunk_tokens: int
) -> list[tuple[int, int, str]]:
    """(start, end, key) of every chunk of ``tokens``; see :func:`chain_keys`.

    ``base`` lists chunk ends already stored for a prefix of ``tokens``: they are kept.
    """
    ends = list(base)
    position = ends[-1] if ends else 0
    while position < len(tokens):
        position = min((position // chunk_tokens + 1) * chunk_tokens, len(tokens))
        ends.append(position)
    keys = chain_keys(fingerprint.to_dict(), tokens, ends)
    return [(start, end, key) for start, end, key in zip([0, *ends], ends, keys)]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify_chain(
    row: SnapshotRow, index: dict[str, ChunkRow], keep: int
) -> list[tuple[ChunkRow, int]]:
    """The chunks covering the first ``keep`` tokens of ``row``, each with its start.

    Checks that each one starts where the previous one ended, lies within the row's
    tokens, and that its key is the one the row's token ids and fingerprint give for that
    range (so a row holds only chunks of its own tokens). Raises :class:`SnapshotRejected`.
    """
    if row.damage:
        raise SnapshotRejected(f"the snapshot's index row is damaged ({row.damage})")
    if not _is_count(row.n_tokens) or len(row.token_ids) != row.n_tokens:
        raise SnapshotRejected("the snapshot's token count does not match its token ids")
    needed: list[tuple[ChunkRow, int]] = []
    ends: list[int] = []
    covered = 0
    for key in row.chunk_keys:
        if covered >= keep:
            break
        entry = index.get(key) if valid_key(key) else None
        if entry is None:
            raise SnapshotRejected(f"snapshot chunk {str(key)[:12]} is missing from the index")
        if entry.path != chunk_name(key):
            raise SnapshotRejected(
                f"snapshot chunk {key[:12]} names a file that is not its own ({entry.path!r})"
            )
        if (
            not _is_count(entry.start)
            or not _is_count(entry.n_tokens)
            or not _is_count(entry.n_bytes)
            or entry.start != covered
            or entry.n_tokens == 0
            or covered + entry.n_tokens > row.n_tokens
        ):
            raise SnapshotRejected(
                f"snapshot chunk {str(key)[:12]} says it covers tokens "
                f"{entry.start}+{entry.n_tokens}, but the chain uses it at {covered}"
            )
        if not isinstance(entry.checksum, str):
            # A damaged index can hold any SQLite type; the file's preamble is built from it.
            raise SnapshotRejected(f"snapshot chunk {key[:12]} has a damaged checksum")
        needed.append((entry, covered))
        covered += entry.n_tokens
        ends.append(covered)
    if covered < keep:
        raise SnapshotRejected(f"snapshot chunks cover {covered} of {keep} tokens")
    if chain_keys(row.fingerprint, row.token_ids, ends) != row.chunk_keys[: len(ends)]:
        raise SnapshotRejected(KEYS_MISMATCH)
    return needed


def best_donor(
    store: Store, session_id: str, fingerprint: Fingerprint, prompt: list[int] | None, n_ctx: int
) -> tuple[SnapshotRow, int] | None:
    """Another session's chunked snapshot sharing the longest prefix with ``prompt``, or a
    whole-state one (a recurrent model's) whose every token the prompt starts with (a
    document's reading: a whole state serves only a prompt that continues it).

    Returns the row and how many tokens to take from it (at most ``n_ctx``), or None
    when no chain shares at least :data:`MIN_DONOR_TOKENS`. A damaged chain, or one whose
    keys do not derive from its tokens, is never a donor.
    """
    if not prompt:
        return None
    wanted = fingerprint.to_dict()
    candidates: list[tuple[int, SnapshotRow]] = []
    for row in store.snapshots():
        if row.damage or row.session_id == session_id or row.fingerprint != wanted:
            continue
        shared = min(common_prefix(row.token_ids, prompt), n_ctx)
        whole = row.format == "blob" and shared == len(row.token_ids) == row.n_tokens
        if shared >= MIN_DONOR_TOKENS and (row.format == "chunks" or whole):
            candidates.append((shared, row))
    candidates.sort(key=lambda item: item[0], reverse=True)
    for shared, row in candidates:
        if row.format == "chunks":
            try:
                verify_chain(row, store.get_chunks(row.chunk_keys), shared)
            except SnapshotRejected:
                continue
        return row, shared
    return None


def base_ends(
    store: Store, session_id: str, tokens: list[int], fingerprint: Fingerprint, n_ctx: int
) -> list[int]:
    """Chunk ends of the stored chain sharing the longest prefix with ``tokens``.

    The session's own chain when it has one with this fingerprint, else a donor's. Only
    chunks that tile the prefix from token 0 count: the first that doesn't ends the list.
    """
    row = store.get_snapshot(session_id)
    if (
        row is None
        or row.damage
        or row.format != "chunks"
        or row.fingerprint != fingerprint.to_dict()
    ):
        donor = best_donor(store, session_id, fingerprint, tokens, n_ctx)
        row = donor[0] if donor else None
    if row is None or row.format != "chunks":
        return []
    shared = common_prefix(row.token_ids, tokens)
    index = store.get_chunks(row.chunk_keys)
    ends: list[int] = []
    covered = 0
    for key in row.chunk_keys:
        entry = index.get(key)
        if (
            entry is None
            or not _is_count(entry.start)
            or not _is_count(entry.n_tokens)
            or entry.start != covered
            or entry.n_tokens == 0
            or entry.start + entry.n_tokens > shared
        ):
            break
        covered = entry.start + entry.n_tokens
        ends.append(covered)
    return ends
