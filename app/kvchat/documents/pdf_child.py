"""The child that reads one PDF's text layer with pypdf (see :mod:`kvchat.documents.pdf_text`).

Standard input: the PDF's bytes. Argument: ``{"max_pages": n, "max_chars": n}``. Standard
output: ``{"text": str, "pages": n}`` or ``{"error": words}`` (a code of
``pdf_text.REFUSALS`` or one line). The parent holds it to CPU, memory and time limits.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import warnings


def read_pdf(raw: bytes, max_pages: int, max_chars: int) -> dict[str, object]:
    """The answer for the PDF ``raw``."""
    from pypdf import PdfReader
    from pypdf.errors import FileNotDecryptedError, PdfReadError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(raw), strict=False)
        if reader.is_encrypted:
            try:
                opened = bool(
                    reader.decrypt("")
                )  # encrypted for its owner only: no password to read
            except (FileNotDecryptedError, NotImplementedError, PyPdfError, ValueError):
                opened = False
            if not opened:
                return {"error": "encrypted"}
        count = len(reader.pages)
        if count == 0:
            return {"error": "is a PDF with no pages"}
        if count > max_pages:
            return {"error": f"is a PDF of {count:,} pages; the limit is {max_pages:,}"}
        texts: list[str] = []
        total = 0
        for page in reader.pages:
            text = page.extract_text() or ""
            total += len(text)
            if total > max_chars:
                return {
                    "error": f"gives over {max_chars:,} characters of text; "
                    f"the limit is {max_chars:,}"
                }
            texts.append(text.strip("\n"))
    except MemoryError:
        return {"error": "memory"}
    except RecursionError:
        return {"error": "is a damaged PDF (its objects nest too deep)"}
    except (PdfReadError, PyPdfError) as exc:
        return {"error": f"is a damaged PDF ({_first_line(exc)})"}
    except Exception as exc:  # pypdf on hostile bytes raises anything: each is "damaged"
        return {"error": f"is a damaged PDF ({type(exc).__name__}: {_first_line(exc)})"}
    if not any(text.strip() for text in texts):
        return {"error": "no-text"}
    return {"text": "\n\n".join(texts), "pages": count}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[0][:200]


def main() -> None:
    logging.disable(logging.CRITICAL)  # pypdf logs each oddity it works around
    warnings.simplefilter("ignore")
    try:
        request = json.loads(sys.argv[1])
        max_pages, max_chars = int(request["max_pages"]), int(request["max_chars"])
        answer = read_pdf(sys.stdin.buffer.read(), max_pages, max_chars)
    except MemoryError:
        answer = {"error": "memory"}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
