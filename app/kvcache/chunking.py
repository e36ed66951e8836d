"""Chunk planning: where a chain of chunks is cut, and what each chunk's key is.

A chunk's key hashes the fingerprint and every token id up to the chunk's end, so any
prefix that sessions, forks and regenerations share gets the same keys and is stored
once. Cuts already stored for a prefix are kept (a turn only appends chunks); after
them, chunks end on multiples of ``chunk_tokens``, plus a trailing partial one.
"""

from __future__ import annotations

import json

import xxhash

from kvchat.engine import common_prefix
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.format import token_bytes
from kvchat.store import SnapshotRow, Store

CHUNK_TOKENS = 256
# A shared prefix shorter than this is not worth borrowing from another session.
MIN_DONOR_TOKENS = 32


def chunk_plan(
    fingerprint: Fingerprint, tokens: list[int], base: list[int], chunk_tokens: int
) -> list[tuple[int, int, str]]:
    """(start, end, key) of every chunk of ``tokens``; the key hashes the whole prefix.

    ``base`` lists chunk ends already stored for a prefix of ``tokens``: they are kept.
    """
    ends = list(base)
    position = ends[-1] if ends else 0
    while position < len(tokens):
        position = min((position // chunk_tokens + 1) * chunk_tokens, len(tokens))
        ends.append(position)
    h = xxhash.xxh3_128(json.dumps(fingerprint.to_dict(), sort_keys=True).encode())
    ids = token_bytes(tokens)
    plan = []
    start = 0
    for end in ends:
        h.update(ids[start * 4 : end * 4])
        plan.append((start, end, h.copy().hexdigest()))
        start = end
    return plan


def best_donor(
    store: Store, session_id: str, fingerprint: Fingerprint, prompt: list[int] | None, n_ctx: int
) -> tuple[SnapshotRow, int] | None:
    """Another session's chunked snapshot sharing the longest prefix with ``prompt``.

    Returns the row and how many tokens to take from it (at most ``n_ctx``), or None
    when no chain shares at least :data:`MIN_DONOR_TOKENS`.
    """
    if not prompt:
        return None
    best: tuple[SnapshotRow, int] | None = None
    wanted = fingerprint.to_dict()
    for row in store.snapshots():
        if row.session_id == session_id or row.format != "chunks" or row.fingerprint != wanted:
            continue
        shared = min(common_prefix(row.token_ids, prompt), n_ctx)
        if shared >= MIN_DONOR_TOKENS and (best is None or shared > best[1]):
            best = (row, shared)
    return best


def base_ends(
    store: Store, session_id: str, tokens: list[int], fingerprint: Fingerprint, n_ctx: int
) -> list[int]:
    """Chunk ends of the stored chain sharing the longest prefix with ``tokens``.

    The session's own chain when it has one with this fingerprint, else a donor's.
    """
    row = store.get_snapshot(session_id)
    if row is None or row.format != "chunks" or row.fingerprint != fingerprint.to_dict():
        donor = best_donor(store, session_id, fingerprint, tokens, n_ctx)
        row = donor[0] if donor else None
    if row is None or row.format != "chunks":
        return []
    shared = common_prefix(row.token_ids, tokens)
    index = store.get_chunks(row.chunk_keys)
    ends = []
    for key in row.chunk_keys:
        entry = index.get(key)
        if entry is None or entry.start + entry.n_tokens > shared:
            break
        ends.append(entry.start + entry.n_tokens)
    return ends
