"""Twenty rounds of two sessions alternating on one llama-server slot, each reply a full
prefill's (a real llama-server)."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.server.test_server import Server
from tests.e2e.server.test_server_faults import _alternate, remote

__all__ = ["remote"]  # fixtures shared with the module they come from


def test_twenty_rounds_alternating_on_one_slot_reply_as_a_full_prefill(
    remote: Server, tmp_path: Path
) -> None:
    assert _alternate(remote.url, tmp_path, rounds=20) == (40, 40)
