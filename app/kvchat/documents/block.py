"""A set of documents → the one text block given to the model after the system prompt.

Byte-identical for the same set of documents, whatever order they were given in: the block is
where reading once pays, since every conversation that names the same documents then starts
with the same tokens and shares their KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape

from kvchat.documents.document import Document, canonical_order


def document_header(document: Document) -> str:
    """The line that opens one document in the block: its name, kind and pages."""
    pages = f' pages="{document.pages}"' if document.pages is not None else ""
    return f'<document name="{escape(document.name)}" kind="{document.kind}"{pages}>'


def render_block(documents: Iterable[Document]) -> str:
    """The documents in canonical order, each between its header line and
    ``</document>``; an empty string for no documents."""
    parts = [
        f"{document_header(d)}\n{d.text.strip(chr(10))}\n</document>"
        for d in canonical_order(documents)
    ]
    return "\n\n".join(parts)
