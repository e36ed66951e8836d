"""What a restore and a save report, for the turn report and ``kvchat cache``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvchat.store import SnapshotRow

Source = Literal["hot", "ram", "disk", "server", "none"]


@dataclass
class RestoreResult:
    """How the session was made hot, for the turn report."""

    source: Source
    ms: float = 0.0
    bytes: int = 0
    tokens: int = 0
    reason: str | None = None
    # Set when the KV came from another session sharing this one's prefix (a fork, an edit).
    donor: str | None = None
    # Where the restored KV came from when not computed here (see Fingerprint.origin).
    origin: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "from": self.source,
            "ms": round(self.ms, 2),
            "bytes": self.bytes,
            "tokens": self.tokens,
            "reason": self.reason,
            "donor": self.donor,
        }


@dataclass
class SaveResult:
    row: SnapshotRow
    bytes_written: int
    chunks_written: int = 0
    chunks_shared: int = 0
    evicted: list[str] = field(default_factory=list)
    # Set when the snapshots on disk still exceed the budget (see over_budget_note).
    over_budget: str | None = None
    # Why the state was stored whole (one blob) instead of in chunks, or None.
    whole_reason: str | None = None
    checkpoints_written: int = 0
