"""The typed value an attachment becomes, and the one order a set of them is kept in."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from kvchat.errors import DocumentError
from kvchat.text import one_line


class Kind(StrEnum):
    """What a document was before it became text."""

    TEXT = "text"
    MARKDOWN = "markdown"
    CODE = "code"
    CSV = "csv"
    HTML = "html"
    PDF = "pdf"


@dataclass(frozen=True)
class Document:
    """One attached file, read and checked: ``text`` is all the model will see of it.

    ``name`` is its path inside the attached folder (``/``-separated) or its file name;
    ``sha256`` is of the raw bytes; ``pages`` is set for a PDF only.
    """

    name: str
    size: int
    sha256: str
    kind: Kind
    text: str = field(repr=False)
    pages: int | None = None


@dataclass(frozen=True)
class Attachment:
    """What one attached path gave: its documents in canonical order, and one line for each
    file of a folder that was skipped (a link, a binary file, …)."""

    documents: tuple[Document, ...]
    notes: tuple[str, ...] = ()


def canonical_order(documents: Iterable[Document]) -> tuple[Document, ...]:
    """``documents`` by name, then sha256, without exact repeats: the same set of documents
    always comes out in the same order, whatever order it was read in."""
    unique = {(d.name, d.sha256): d for d in documents}
    return tuple(unique[key] for key in sorted(unique))


def display_name(name: str) -> str:
    """A file name as it may be shown and given to the model: bytes that are not UTF-8 as
    ``\\xNN``, no control characters, on one line."""
    raw = name.encode("utf-8", "surrogateescape")
    return one_line(raw.decode("utf-8", "backslashreplace")) or "?"


def refuse(name: str, problem: str) -> DocumentError:
    """The one-line error for the file ``name`` and its ``problem``."""
    return DocumentError(one_line(f"{display_name(name)}: {problem}"))
