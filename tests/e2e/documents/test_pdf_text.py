"""A PDF's text layer, read in a child process held to limits: text with its page count, or one
line for an encrypted, scanned, damaged or hostile PDF, within a time cap."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import pytest

from kvchat.documents import Kind, ReadBounds, read_document
from kvchat.errors import DocumentError
from tests.unit.documents.pdf_making import (
    encrypted_pdf,
    image_only_pdf,
    nested_pdf,
    pdf_of,
    stream,
    text_pdf,
    zero_bomb_pdf,
)


def refusal(tmp_path: Path, raw: bytes, bounds: ReadBounds = ReadBounds()) -> str:
    path = tmp_path / "doc.pdf"
    path.write_bytes(raw)
    started = time.monotonic()
    with pytest.raises(DocumentError) as caught:
        read_document(path, bounds=bounds)
    assert time.monotonic() - started < bounds.pdf_wall_s + 10
    line = str(caught.value)
    assert "\n" not in line and line.startswith("doc.pdf: ")
    return line


def test_a_pdf_with_a_text_layer_gives_its_text_and_page_count(tmp_path: Path) -> None:
    path = tmp_path / "paper.pdf"
    path.write_bytes(text_pdf(["Read once,\nask forever", "Page two (x)"]))
    document = read_document(path)
    assert document.kind is Kind.PDF and document.pages == 2
    assert document.text == "Read once,\nask forever\n\nPage two (x)"


def test_an_encrypted_pdf_is_one_line(tmp_path: Path) -> None:
    assert refusal(tmp_path, encrypted_pdf()) == (
        "doc.pdf: is an encrypted PDF (kvchat reads no password-protected PDF)"
    )


def test_a_pdf_without_a_text_layer_is_one_line(tmp_path: Path) -> None:
    assert refusal(tmp_path, image_only_pdf()) == "doc.pdf: is a PDF with no text layer (a scan?)"


def test_a_cut_pdf_is_damaged(tmp_path: Path) -> None:
    raw = text_pdf(["hello"])
    assert "is a" in refusal(tmp_path, raw[: len(raw) // 3])


def test_deep_nesting_is_damaged_not_a_crash(tmp_path: Path) -> None:
    assert refusal(tmp_path, nested_pdf(100_000)).startswith("doc.pdf: is a damaged PDF")


def test_a_zero_bomb_yields_no_text_not_a_gigabyte(tmp_path: Path) -> None:
    assert refusal(tmp_path, zero_bomb_pdf(200)) == "doc.pdf: is a PDF with no text layer (a scan?)"


def test_a_page_of_a_million_operators_is_stopped_by_the_cpu_limit(tmp_path: Path) -> None:
    """Measured in-process: 5 s and 320 MB for this 12 KB file; the child's CPU limit (1 s
    here) ends it with one line."""
    ops = b"BT /F1 12 Tf 72 720 Td " + b"(ab) Tj " * 1_000_000 + b"ET"
    raw = pdf_of(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
            stream(zlib.compress(ops, 9), b"/Filter /FlateDecode"),
        ]
    )
    line = refusal(tmp_path, raw, ReadBounds(pdf_cpu_s=1, pdf_wall_s=20))
    assert line == "doc.pdf: is a PDF that took over 1 s of CPU to read"


def test_text_over_the_limit_is_refused_with_the_limit(tmp_path: Path) -> None:
    raw = text_pdf(["x" * 80, "y" * 80])
    line = refusal(tmp_path, raw, ReadBounds(max_text_chars=100))
    assert line == "doc.pdf: gives over 100 characters of text; the limit is 100"


def test_more_pages_than_the_limit_are_refused(tmp_path: Path) -> None:
    line = refusal(tmp_path, text_pdf(["a", "b", "c"]), ReadBounds(max_pdf_pages=2))
    assert line == "doc.pdf: is a PDF of 3 pages; the limit is 2"
