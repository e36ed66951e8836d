"""``kvchat bench --peers --json`` at a small size: every row is there (llama-server's
measured where one is built, else the row says why not), every ratio is against the re-read
of the same run, and each restore was verified (the greedy reply after it equal to the same
peer's full read, or the row says it was not). Counts and flags are asserted, never speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.bench.peers import DISK_CACHE, KVCHAT_DISK, KVCHAT_RAM, PEERS, RE_READ, SERVER
from kvchat.engine.server_build import find_binary


@pytest.mark.stress  # every peer (llama-server, LlamaDiskCache) at a small size: ~1 CPU-min; unit/bench checks its report
def test_e2e_bench_peers_rows_ratios_and_verified_restores(kvhome: Path, cli) -> None:
    result = cli(
        kvhome,
        "bench",
        "--peers",
        "--json",
        "--sizes",
        "300",
        "--repeat",
        "1",
        "--turns",
        "3",
        "--conversations",
        "3",
        "--prefix",
        "300",
    )
    report = result.json
    rows = {row["peer"]: row for row in report["rows"]}
    assert list(rows) == list(PEERS)
    (size,) = [str(s) for s in report["sizes"]]
    history = int(size)
    assert 300 <= history < 700

    server = rows[SERVER]
    if find_binary() is None:
        assert "kvchat server build" in server["missing"]
    else:
        assert server["missing"] is None
    measured = [row for row in rows.values() if row["missing"] is None]
    assert len(measured) == (5 if find_binary() is not None else 4)

    reread = rows[RE_READ]
    assert reread["sooner"] == {size: 1.0}
    for row in measured:
        # Every ratio against the same run's re-read.
        ttft = row["ttft_ms"][size]
        assert ttft > 0
        assert (
            abs(row["sooner"][size] - reread["ttft_ms"][size] / ttft)
            <= 0.01 * row["sooner"][size] + 0.002
        )
        # Verified: a flag, and a note where it is not equal.
        assert isinstance(row["greedy_equal"], bool), row
        if not row["greedy_equal"]:
            assert "differs at" in row["greedy_note"]
        assert row["foreign"]
        # Each peer's own full read of the same prompt, and its resume against it.
        own = row["own_reread_ms"][size]
        assert own > 0
        assert abs(row["sooner_than_own"][size] - own / ttft) <= 0.01 * own / ttft + 0.002
    # kvchat's own restores equal a full read, from disk and from RAM.
    assert rows[KVCHAT_DISK]["greedy_equal"] is True
    assert rows[KVCHAT_RAM]["greedy_equal"] is True
    # The re-read reads the whole prompt; a restore only the new message and its markup.
    assert reread["decoded"][size] > history
    for peer in (DISK_CACHE, KVCHAT_DISK, KVCHAT_RAM):
        assert 0 < rows[peer]["decoded"][size] < 60, (peer, rows[peer]["decoded"])

    # Writes: nothing for re-read; kvchat writes each new token's KV once; a whole state
    # per turn writes more.
    assert reread["written_per_turn"] == 0
    kv = rows[KVCHAT_DISK]
    assert 0.9 <= kv["written_over_new_kv"] <= 1.1
    assert rows[DISK_CACHE]["written_over_new_kv"] > kv["written_over_new_kv"]
    # Conversations on one prefix: kvchat stores the prefix once.
    assert reread["shared_disk_bytes"] == 0
    assert 0.9 <= kv["shared_over_kv"] <= 1.5
    assert rows[DISK_CACHE]["shared_over_kv"] > 2
    # Every conversation still restorable at the end (kvchat; the server's files stay).
    assert kv["shared_kept"] == 3
    if server["missing"] is None:
        assert server["shared_kept"] == 3
    # Another KV type's snapshot: kvchat refuses it and reads again.
    assert kv["foreign"].startswith("rejected: ") and "read again" in kv["foreign"]
    assert rows[DISK_CACHE]["foreign"].split(":")[0] in {"rejected", "accepted", "crashed"}
    if server["missing"] is None:
        assert server["foreign"].split(":")[0] in {"rejected", "accepted", "crashed"}
    assert report["headline"][0].startswith(f"resuming a {history:,}-token conversation")
