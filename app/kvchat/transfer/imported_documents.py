"""A conversation's documents as an export or a bundle carries them, read at the boundary.

An export's ``documents`` list holds each document's name, kind, size, sha256, pages, the
text the model read and ``message``: the index in the export's ``messages`` of the one it
came with (null: given at the start). Each is bounded like a file read here
(:mod:`kvchat.documents.bounds`): a name as kvchat shows names, a known kind, a size a
file could have, a sha256 of 64 hex digits (kept as it came: no bytes come to re-derive
it), a text under the same limits and already as clean as extraction leaves it. The
text is what the model reads, so it is never changed on the way in: a text that
extraction would not have given is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvchat.documents import Kind
from kvchat.documents.bounds import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_PDF_PAGES,
    MAX_TEXT_CHARS,
    MAX_TOTAL_TEXT_CHARS,
)
from kvchat.documents.document import display_name
from kvchat.documents.formats import clean_text
from kvchat.transfer.common import BadFile, ImportedDocument, check_text

# Documents one conversation may carry (each attach gives at most MAX_FILES of them).
MAX_SESSION_DOCUMENTS = 10_000
# A document's name: a path inside an attached folder.
MAX_NAME_CHARS = 4_096
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = frozenset(str(kind) for kind in Kind)


def _count(value: object, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def read_document(path: Path, item: object, where: str, kept: dict[int, int]) -> ImportedDocument:
    """One entry of ``documents``; ``kept`` maps an index in the file's ``messages`` to the
    imported message's index (the system prompt is not one)."""
    if not isinstance(item, dict):
        raise BadFile(path, f"{where} is not an object")
    name = check_text(path, item.get("name"), f"{where}.name")
    assert name is not None
    if not name or len(name) > MAX_NAME_CHARS or display_name(name) != name:
        raise BadFile(path, f"{where}.name is not a document name kvchat would give")
    kind = item.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise BadFile(path, f"{where}.kind is not one of {', '.join(sorted(_KINDS))}")
    size = item.get("size")
    if not _count(size, MAX_FILE_BYTES):
        raise BadFile(path, f"{where}.size is not a file size up to {MAX_FILE_BYTES:,} bytes")
    sha256 = item.get("sha256")
    if not isinstance(sha256, str) or _SHA256.fullmatch(sha256) is None:
        raise BadFile(path, f"{where}.sha256 is not 64 lowercase hex digits")
    pages = item.get("pages")
    if pages is not None and not _count(pages, MAX_PDF_PAGES):
        raise BadFile(path, f"{where}.pages is not a page count up to {MAX_PDF_PAGES:,}")
    text = check_text(path, item.get("text"), f"{where}.text")
    assert text is not None
    if len(text) > MAX_TEXT_CHARS:
        raise BadFile(path, f"{where}.text is over {MAX_TEXT_CHARS:,} characters")
    if clean_text(text) != text:
        raise BadFile(
            path,
            f"{where}.text holds control characters, escape sequences or CR line ends "
            "(a document's text as kvchat reads it has none)",
        )
    message = item.get("message")
    if message is not None:
        if not _count(message, 1 << 31) or message not in kept:
            raise BadFile(path, f"{where}.message names no user or assistant message")
        message = kept[message]
    return ImportedDocument(name, str(kind), size, sha256, text, pages, message)


def read_documents(path: Path, value: object, kept: dict[int, int]) -> list[ImportedDocument]:
    """The ``documents`` list of a kvchat export (absent or null: none), each entry checked
    (:func:`read_document`); per place (the start, each message) no more documents and text
    than one attach may give, and no document twice."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadFile(path, "documents is not a list")
    if len(value) > MAX_SESSION_DOCUMENTS:
        raise BadFile(path, f"{len(value):,} documents is over the {MAX_SESSION_DOCUMENTS:,} limit")
    documents: list[ImportedDocument] = []
    seen: set[tuple[int | None, str, str]] = set()
    counts: dict[int | None, tuple[int, int]] = {}
    for index, item in enumerate(value):
        where = f"documents[{index}]"
        doc = read_document(path, item, where, kept)
        key = (doc.message, doc.name, doc.sha256)
        if key in seen:
            raise BadFile(path, f"{where} repeats a document given at the same place")
        seen.add(key)
        files, chars = counts.get(doc.message, (0, 0))
        files, chars = files + 1, chars + len(doc.text)
        if files > MAX_FILES or chars > MAX_TOTAL_TEXT_CHARS:
            raise BadFile(
                path,
                f"{where}: more documents or text at one place than one attach gives "
                f"({MAX_FILES:,} files, {MAX_TOTAL_TEXT_CHARS:,} characters)",
            )
        counts[doc.message] = (files, chars)
        documents.append(doc)
    return documents
