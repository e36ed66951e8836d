"""The one exception a snapshot that can't be trusted raises on its way to a prefill."""

from __future__ import annotations


class SnapshotRejected(Exception):
    """A snapshot (or one of its files) failed a check; ``reason`` is shown to the user.

    Raised where the problem is found; :meth:`SnapshotStore.restore` catches it and
    falls back to a full prefill, reporting the reason.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
