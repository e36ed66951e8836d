"""The warm tier (RAM): LRU within its byte budget, and a spill reuses a buffer already
written once (a fresh ~100 MB buffer page-faulted for ~50 ms of a session
switch; a reused one is a copy)."""

from __future__ import annotations

import ctypes

from kvchat.kvcache.warm import HEADROOM, WarmTier

MIB = 1 << 20


def state(size: int, fill: int) -> memoryview:
    return memoryview(bytes([fill]) * size)


def loaded(tier: WarmTier, session_id: str) -> bytes:
    entry = tier.get(session_id, "m")
    assert entry is not None
    return ctypes.string_at(entry.pointer(), entry.n_bytes)


def test_a_session_spilled_again_reuses_its_buffer_and_reads_back_its_new_state() -> None:
    tier = WarmTier(64 * MIB)
    assert tier.put("a", [1, 2], state(3 * MIB, 1), "m")
    first = tier._entries["a"].buffer
    assert tier.put("a", [1, 2, 3], state(3 * MIB + 4096, 2), "m")  # a turn longer
    assert tier._entries["a"].buffer is first
    assert loaded(tier, "a") == bytes([2]) * (3 * MIB + 4096)
    assert tier.get("a", "other model") is None


def test_an_evicted_buffer_serves_the_next_session_and_the_budget_holds() -> None:
    size = 8 * MIB
    tier = WarmTier(2 * (size + HEADROOM) + MIB)  # room for two
    for name, fill in (("a", 1), ("b", 2)):
        assert tier.put(name, [fill], state(size, fill), "m")
    oldest = tier._entries["a"].buffer
    assert tier.put("c", [3], state(size, 3), "m")
    assert "a" not in tier and tier._entries["c"].buffer is oldest
    assert tier.bytes <= tier.budget_bytes
    assert loaded(tier, "b") == bytes([2]) * size and loaded(tier, "c") == bytes([3]) * size
    assert not tier.put("huge", [4], state(tier.budget_bytes, 4), "m")
    assert "huge" not in tier
