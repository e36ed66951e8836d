"""Text from users, models and files, checked on the way in and made harmless on the way out.

Nothing here imports a UI library: the CLI and the TUI both show stored and generated text
through :func:`visible`, and every way text enters the service passes :func:`check_text`.
"""

from __future__ import annotations

import re
import unicodedata

from kvchat.errors import KvchatError

# What a terminal would act on rather than show: escape sequences (CSI, OSC and the other
# strings ended by BEL or ST; two-byte escapes), then any lone C0/C1 control but tab and
# newline. An unterminated string sequence loses only its introducer, never the text after it.
_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|\x1b[ -/]*[0-~]"
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def visible(text: str) -> str:
    """``text`` as it may reach the terminal: without escape sequences or control characters
    (stored text is shown, never obeyed). Tabs and line breaks stay; CRLF becomes LF."""
    text = text.replace("\r\n", "\n")
    return _CONTROL.sub("", _SEQUENCE.sub("", text))


def one_line(text: str) -> str:
    """``text`` visible and on one line (an error message, a title in a table)."""
    return " ".join(visible(text).split())


# Markdown markup that says nothing in a one-line title: heading and quote marks, list
# bullets, emphasis and code marks, a link's target (its text stays).
_MARKUP = [
    (re.compile(r"(?m)^\s{0,3}(?:#{1,6}\s+|>\s*|[-*+]\s+|\d+[.)]\s+)"), ""),
    (re.compile(r"!?\[([^\]]*)\]\([^)]*\)"), r"\1"),
    (re.compile(r"(\*\*|\*|`+|~~)(?=\S)(.+?)(?<=\S)\1"), r"\2"),
    (re.compile(r"(?<!\w)(__|_)(?=\S)(.+?)(?<=\S)\1(?!\w)"), r"\2"),
    (re.compile(r"`+"), ""),
]


def plain(text: str) -> str:
    """``text`` without its Markdown markup (``# Heading **bold**`` → ``Heading bold``)."""
    for pattern, replacement in _MARKUP:
        text = pattern.sub(replacement, text)
    return text


def short_title(text: str, limit: int = 48) -> str:
    """A session's title from its first message: the text on one line, without Markdown
    markup, cut at ``limit``."""
    line = one_line(plain(text)) or one_line(text)
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def display_width(text: str) -> int:
    """How many terminal columns ``text`` takes: wide (CJK) characters two, combining marks
    none (so that columns of a table line up whatever the script)."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def fit_width(text: str, width: int) -> str:
    """``text`` cut (with "…") and padded to exactly ``width`` terminal columns."""
    if display_width(text) > width:
        out, used = "", 0
        for ch in text:
            w = display_width(ch)
            if used + w > width - 1:
                break
            out, used = out + ch, used + w
        text = out + "…"
    return text + " " * (width - display_width(text))


def check_text(text: str, what: str = "the message") -> str:
    """``text`` if it is valid Unicode (storable as UTF-8), else a :class:`KvchatError`.

    Python hands bytes of a command line that are not UTF-8 over as lone surrogates
    (``surrogateescape``); SQLite and the tokenizer would fail on them later, after a
    session was made, so they are refused first.
    """
    if _SURROGATE.search(text):
        raise KvchatError(f"{what} is not valid UTF-8 text")
    return text


# A title the model writes: at most this many words.
TITLE_WORDS = 8
_TITLE_LABEL = re.compile(r"^(?:title|conversation|name)\s*[:\-–]\s*", re.IGNORECASE)


def model_title(reply: str) -> str | None:
    """A title from what a model wrote when asked for one: its first line, without
    quotes, Markdown or a "Title:" label, up to the first sentence's end, at most
    :data:`TITLE_WORDS` words; None when nothing usable is left."""
    lines = [line for line in visible(reply).splitlines() if line.strip()]
    if not lines:
        return None
    quotes = " \"'“”‘’«»*#"
    line = _TITLE_LABEL.sub("", one_line(plain(lines[0])).strip(quotes))
    line = re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]
    line = line.strip(quotes).rstrip(".!?:;,")
    words = line.split()
    if not words:
        return None
    return short_title(" ".join(words[:TITLE_WORDS]))
