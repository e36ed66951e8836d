"""The block the model reads after the system prompt: one per set of documents, byte for
byte, whatever order they came in."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from kvchat.documents import Document, Kind, attach, canonical_order, render_block


def doc(name: str, text: str, kind: Kind = Kind.TEXT, pages: int | None = None) -> Document:
    raw = text.encode()
    return Document(name, len(raw), hashlib.sha256(raw).hexdigest(), kind, text, pages)


def test_the_block_names_each_document_in_a_header_line() -> None:
    block = render_block([doc("b.md", "Bee\n", Kind.MARKDOWN), doc("a.pdf", "A", Kind.PDF, 2)])
    assert block == (
        '<document name="a.pdf" kind="pdf" pages="2">\nA\n</document>\n\n'
        '<document name="b.md" kind="markdown">\nBee\n</document>'
    )


def test_the_same_documents_in_any_order_give_the_same_bytes() -> None:
    docs = [doc(f"f{i % 7}.txt", f"text {i}") for i in range(30)]
    first = render_block(docs)
    for seed in range(5):
        random.Random(seed).shuffle(docs)
        assert render_block(docs) == first


def test_equal_names_are_ordered_by_hash_and_exact_repeats_kept_once() -> None:
    one, two = doc("same.txt", "one"), doc("same.txt", "two")
    ordered = canonical_order([two, one, two])
    assert [d.sha256 for d in ordered] == sorted([one.sha256, two.sha256])


def test_a_name_cannot_break_out_of_its_header() -> None:
    block = render_block([doc('x" kind="pdf', "t")])
    assert block.splitlines()[0] == '<document name="x&quot; kind=&quot;pdf" kind="text">'


def test_no_documents_is_an_empty_block() -> None:
    assert render_block([]) == ""


def test_a_folder_read_twice_renders_identically(tmp_path: Path) -> None:
    for name in ("b.md", "a.txt", "sub/c.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")
    assert render_block(attach(tmp_path).documents) == render_block(attach(tmp_path).documents)
