"""Raw bytes of one file → its kind and its text: UTF-8 text as it is, HTML through
BeautifulSoup, PDF through pypdf (in a child process: see :mod:`kvchat.documents.pdf_text`).

Whatever the format, the text that comes out is text: terminal escapes and control
characters removed (:func:`kvchat.text.visible`), newlines made ``\\n``.
"""

from __future__ import annotations

import codecs
import re
from pathlib import PurePosixPath

from kvchat.documents.bounds import ReadBounds
from kvchat.documents.document import Kind, refuse
from kvchat.documents.pdf_text import pdf_text
from kvchat.text import visible
from kvchat.units import human_bytes

PDF_MAGIC = b"%PDF-"
_SUFFIX_KINDS = {
    ".md": Kind.MARKDOWN,
    ".markdown": Kind.MARKDOWN,
    ".csv": Kind.CSV,
    ".tsv": Kind.CSV,
    ".html": Kind.HTML,
    ".htm": Kind.HTML,
    ".xhtml": Kind.HTML,
    ".pdf": Kind.PDF,
}
_CODE_SUFFIXES = frozenset(
    ".py .pyi .c .h .cc .cpp .hpp .cs .java .kt .go .rs .rb .php .js .mjs .ts .tsx .jsx .swift"
    " .m .scala .lua .pl .r .jl .sh .bash .zsh .fish .ps1 .sql .css .scss .toml .yaml .yml"
    " .json .xml .ini .cfg .mk .cmake .gradle .dart .ex .exs .erl .hs .ml .zig .nim .vue".split()
)
_CODE_NAMES = frozenset({"Makefile", "Dockerfile", "CMakeLists.txt", "Justfile"})
# Byte-order marks of the encodings that are not UTF-8 (UTF-32 first: its LE mark starts
# with UTF-16's).
_OTHER_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
# Elements whose text is not the page's (dropped), and those that stand on lines of their own.
_HIDDEN = ("script", "style", "noscript", "template", "head", "svg", "iframe", "object")
_BLOCKS = frozenset(
    "address article aside blockquote dd details div dl dt fieldset figcaption figure footer"
    " form h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section summary table tr ul"
    " caption thead tbody tfoot title".split()
)
_SPACES = re.compile(r"[ \t\f\v\r\n]+")
_BLANK_RUNS = re.compile(r"\n{3,}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def kind_of(name: str, raw: bytes) -> Kind:
    """The kind of the file ``name`` holding ``raw``: a PDF by its magic bytes or suffix, the
    rest by suffix (unknown suffixes are plain text)."""
    if raw.startswith(PDF_MAGIC):
        return Kind.PDF
    path = PurePosixPath(name)
    suffix = path.suffix.lower()
    if suffix in _SUFFIX_KINDS:
        return _SUFFIX_KINDS[suffix]
    if suffix in _CODE_SUFFIXES or path.name in _CODE_NAMES:
        return Kind.CODE
    return Kind.TEXT


def extract(name: str, kind: Kind, raw: bytes, bounds: ReadBounds) -> tuple[str, int | None]:
    """The text of ``raw`` (a file of ``kind`` called ``name``) and, for a PDF, its page
    count; a :class:`~kvchat.errors.DocumentError` when it has none kvchat will read."""
    pages: int | None = None
    if kind is Kind.PDF:
        if not raw.startswith(PDF_MAGIC):
            raise refuse(name, "is not a PDF (it does not start with %PDF-)")
        text, pages = pdf_text(name, raw, bounds)
    elif kind is Kind.HTML:
        if len(raw) > bounds.max_html_bytes:
            raise refuse(
                name,
                f"is {human_bytes(len(raw))} of HTML; the limit is "
                f"{human_bytes(bounds.max_html_bytes)}",
            )
        text = html_to_text(decode_utf8(name, raw))
    else:
        text = decode_utf8(name, raw)
    text = clean_text(text)
    if len(text) > bounds.max_text_chars:
        raise refuse(
            name,
            f"gives {len(text):,} characters of text; the limit is {bounds.max_text_chars:,}",
        )
    return text, pages


def decode_utf8(name: str, raw: bytes) -> str:
    """``raw`` as UTF-8 text (a UTF-8 byte-order mark dropped). Anything else is refused with
    the reason: a NUL byte (binary), another encoding's mark, a byte that is not UTF-8.

    kvchat reads UTF-8 only and guesses no encoding: a wrong guess would give the model
    wrong text without a word, where a refusal says how to fix it."""
    for mark, encoding in _OTHER_BOMS:
        if raw.startswith(mark):
            raise refuse(name, f"is {encoding} text; only UTF-8 is read (convert it to UTF-8)")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise refuse(name, f"is binary (a NUL byte at offset {nul:,}), not text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start : exc.start + 1].hex()
        raise refuse(
            name,
            f"is not UTF-8 text (byte 0x{bad} at offset {exc.start:,}); "
            "only UTF-8 is read (convert it to UTF-8)",
        ) from None


def clean_text(text: str) -> str:
    """``text`` as the model may read it: CRLF and CR made LF, escape sequences and control
    characters but tab and newline removed, lone surrogates replaced."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return visible(_SURROGATE.sub("\ufffd", text))


def html_to_text(markup: str) -> str:
    """The text a reader sees in ``markup``: scripts, styles and comments dropped, white space
    collapsed as a browser does (but in ``<pre>``), each block element on lines of its own.

    One walk over the parsed tree with a stack of its own: time linear in the elements and no
    recursion however deep they nest (editing the tree in place took minutes on 50,000
    nested ``<div>``).
    """
    # Imported here: BeautifulSoup costs 0.16 s at start-up, and every kvchat command
    # imports this module.
    from bs4 import BeautifulSoup
    from bs4.element import NavigableString, PageElement, Tag

    soup = BeautifulSoup(markup, "html.parser")
    out: list[str] = []
    in_pre = 0
    stack: list[PageElement | str] = [soup]
    while stack:
        node = stack.pop()
        if isinstance(node, str) and not isinstance(node, NavigableString):
            out.append("\n" if node in _BLOCKS else "\t")  # a block or a cell ends
            in_pre -= node == "pre"
        elif isinstance(node, Tag):
            if node.name in _HIDDEN:
                continue
            if node.name == "br":
                out.append("\n")
            elif node.name in _BLOCKS:
                out.append("\n")
            if node.name in _BLOCKS or node.name in ("td", "th"):
                stack.append(str(node.name))
            in_pre += node.name == "pre"
            stack.extend(reversed(node.contents))
        elif type(node) is NavigableString:  # not a comment, doctype, CDATA…
            out.append(str(node) if in_pre else _SPACES.sub(" ", node))
    lines = [line.rstrip() for line in "".join(out).split("\n")]
    lines = [line[1:] if line.startswith(" ") and line[1:2] != " " else line for line in lines]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip("\n")
