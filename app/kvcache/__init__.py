"""KV snapshots: fingerprints, the snapshot file format, and the tiers that hold them."""

from kvchat.kvcache.errors import SnapshotRejected
from kvchat.kvcache.fingerprint import Fingerprint, model_identity
from kvchat.kvcache.snapshots import RestoreResult, SaveResult, SnapshotStore

__all__ = [
    "Fingerprint",
    "RestoreResult",
    "SaveResult",
    "SnapshotRejected",
    "SnapshotStore",
    "model_identity",
]
