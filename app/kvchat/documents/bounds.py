"""How much one attachment may hold: named limits, and the record that carries them.

Every limit has a default here; a caller (a test, a setting) may pass smaller ones through
:class:`ReadBounds`. Each error line that a limit causes names it.
"""

from __future__ import annotations

from dataclasses import dataclass

# One file, before it is read: its size in bytes.
MAX_FILE_BYTES = 32 << 20
# HTML is parsed in Python (BeautifulSoup's html.parser: ~1 MB/s on a busy 2-core machine).
MAX_HTML_BYTES = 2 << 20
# The text one document gives, after extraction (about 500,000 tokens: far over any context).
MAX_TEXT_CHARS = 2_000_000
# A folder: the entries looked at (files, folders, ignored ones too), the files that match,
# their bytes together, the text of all its documents, and how deep it is walked.
MAX_ENTRIES = 20_000
MAX_FILES = 1_000
MAX_TOTAL_BYTES = 64 << 20
MAX_TOTAL_TEXT_CHARS = 4_000_000
MAX_DEPTH = 16
# A .gitignore file (read for its patterns).
MAX_IGNORE_FILE_BYTES = 256 << 10
# A PDF is read in a child process held to these: pages, CPU seconds, wall seconds, memory.
MAX_PDF_PAGES = 2_000
PDF_CPU_S = 20
PDF_WALL_S = 30.0
PDF_MEMORY_BYTES = 1 << 30


@dataclass(frozen=True)
class ReadBounds:
    """The limits one read of an attachment keeps (defaults: the constants above)."""

    max_file_bytes: int = MAX_FILE_BYTES
    max_html_bytes: int = MAX_HTML_BYTES
    max_text_chars: int = MAX_TEXT_CHARS
    max_entries: int = MAX_ENTRIES
    max_files: int = MAX_FILES
    max_total_bytes: int = MAX_TOTAL_BYTES
    max_total_text_chars: int = MAX_TOTAL_TEXT_CHARS
    max_depth: int = MAX_DEPTH
    max_pdf_pages: int = MAX_PDF_PAGES
    pdf_cpu_s: int = PDF_CPU_S
    pdf_wall_s: float = PDF_WALL_S
    pdf_memory_bytes: int = PDF_MEMORY_BYTES


DEFAULT_BOUNDS = ReadBounds()
