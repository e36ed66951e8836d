"""KV snapshots: fingerprints, the snapshot file format, and the tiers that hold them."""

from kvchat.kvcache.fingerprint import Fingerprint, model_identity
from kvchat.kvcache.snapshots import RestoreResult, SnapshotStore

__all__ = ["Fingerprint", "RestoreResult", "SnapshotStore", "model_identity"]
