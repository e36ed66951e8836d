"""Attachments: files and folders a user names, read once at the boundary into typed, bounded
documents (:class:`Document`), and the one text block they become for the model.

Nothing here knows a session, the store or the engine: the service decides where the block
goes in a prompt.
"""

from __future__ import annotations

from kvchat.documents.attach import attach
from kvchat.documents.block import render_block
from kvchat.documents.bounds import DEFAULT_BOUNDS, ReadBounds
from kvchat.documents.document import Attachment, Document, Kind, canonical_order
from kvchat.documents.reading import read_document

__all__ = [
    "DEFAULT_BOUNDS",
    "Attachment",
    "Document",
    "Kind",
    "ReadBounds",
    "attach",
    "canonical_order",
    "read_document",
    "render_block",
]
