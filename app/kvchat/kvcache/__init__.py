"""KV snapshots: fingerprints, the snapshot file format, and the tiers that hold them."""

from kvchat.kvcache.cold.snapshot_store import RestoreResult, SaveResult, SnapshotStore
from kvchat.kvcache.fingerprint import Fingerprint, model_identity
from kvchat.kvcache.rejected import SnapshotRejected

__all__ = [
    "Fingerprint",
    "RestoreResult",
    "SaveResult",
    "SnapshotRejected",
    "SnapshotStore",
    "model_identity",
]
