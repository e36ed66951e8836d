"""Real PDF files made in the tests themselves: a text layer, no text layer, encrypted, bombs.

The PDFs are written object by object with a computed cross-reference table (what a PDF
writer does), so every byte a test feeds to kvchat is visible here; pypdf's own writer
encrypts one.
"""

from __future__ import annotations

import io
import zlib

from pypdf import PdfReader, PdfWriter


def pdf_of(objects: list[bytes]) -> bytes:
    """A PDF whose object ``i + 1`` is ``objects[i]`` (object 1 the catalog), with a valid
    cross-reference table and trailer."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\n" % (len(objects) + 1)
    out += b"startxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def stream(data: bytes, extra: bytes = b"") -> bytes:
    return b"<< /Length %d %s >>\nstream\n" % (len(data), extra) + data + b"\nendstream"


def _escape(line: str) -> bytes:
    return (
        line.replace("\\", "\\\\")
        .replace("(", "\\(")
        .replace(")", "\\)")
        .encode("latin-1", "replace")
    )


def text_pdf(pages: list[str]) -> bytes:
    """A PDF with a Helvetica text layer: one page per string, each line of it one line."""
    n = len(pages)
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(n))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, n),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for i, page in enumerate(pages):
        ops = b"BT /F1 12 Tf 14 TL 72 720 Td "
        ops += b" ".join(b"(%s) '" % _escape(line) for line in page.split("\n")) + b" ET"
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * i)
        )
        objects.append(stream(ops))
    return pdf_of(objects)


def image_only_pdf() -> bytes:
    """A page that paints a grey image and has no text: what a scan looks like."""
    pixels = bytes(range(256)) * 16
    return pdf_of(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /XObject << /Im1 4 0 R >> >> /Contents 5 0 R >>",
            stream(
                pixels,
                b"/Type /XObject /Subtype /Image /Width 64 /Height 64 "
                b"/ColorSpace /DeviceGray /BitsPerComponent 8",
            ),
            stream(b"q 612 0 0 792 0 0 cm /Im1 Do Q"),
        ]
    )


def encrypted_pdf(text: str = "secret", password: str = "hunter2") -> bytes:
    """A text PDF encrypted by pypdf's writer with a user password."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([text]))))
    writer.encrypt(user_password=password, owner_password=password, algorithm="AES-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def nested_pdf(depth: int) -> bytes:
    """A page whose resources hold arrays nested ``depth`` deep (a parser recursing on it)."""
    nest = b"[" * depth + b"]" * depth
    return pdf_of(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Deep "
            + nest
            + b" /Contents 4 0 R >>",
            stream(b"BT /F1 12 Tf 72 720 Td (deep) Tj ET"),
        ]
    )


def zero_bomb_pdf(megabytes: int) -> bytes:
    """A page whose content stream inflates from a few KiB to ``megabytes`` MiB of zeros."""
    packed = zlib.compress(b"\0" * (megabytes << 20), 9)
    return pdf_of(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
            stream(packed, b"/Filter /FlateDecode"),
        ]
    )


def many_pages_pdf(pages: int) -> bytes:
    """``pages`` pages sharing one content stream: a small file that is long to walk."""
    kids = b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        stream(b"BT /F1 12 Tf 72 720 Td (again) Tj ET"),
    ]
    objects += [
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 3 0 R >> >> /Contents 4 0 R >>"
    ] * pages
    return pdf_of(objects)
