"""Paths typed or pasted into a message that name existing files or folders.

The app only *offers* them as attachments (the message is text and is sent as typed when the
user declines). A path counts when it looks like one (absolute, ``~``, ``./`` or ``../``,
a ``file://`` URI as terminals paste a dropped file, or a name with a separator or an
extension) and names something that exists. Quoted paths may hold spaces. Nothing here reads
a file: only ``stat`` through ``exists``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

# Bounds: a long paste is scanned only so far, and only so many candidates are checked.
MAX_SCANNED_CHARS = 20_000
MAX_CANDIDATES = 32
MAX_PATH_CHARS = 4_096
MAX_OFFERED = 8

# A quoted run (either quote), or a run without white space.
_WORDS = re.compile(r"'([^'\n]{1,4096})'|\"([^\"\n]{1,4096})\"|(\S{1,4096})")
_TRAILING = ".,;:!?)]}>'\""
_LEADING = "([{<'\""
_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,10}$")


def _looks_like_path(word: str) -> bool:
    return (
        word.startswith(("/", "~", "./", "../", "file://"))
        or "/" in word
        or bool(_EXTENSION.search(word))
    )


def _as_path(word: str) -> str | None:
    """The path a word names as typed (a ``file://`` URI decoded), or None."""
    if word.startswith("file://"):
        try:
            parsed = urlparse(word)
        except ValueError:  # "file://[…": an unclosed IPv6 bracket
            return None
        if parsed.netloc not in ("", "localhost"):
            return None
        word = unquote(parsed.path)
    if not word or "\x00" in word or len(word) > MAX_PATH_CHARS:
        return None
    return word


def _exists(path: str, cwd: Path) -> bool:
    try:
        candidate = Path(path).expanduser()
        if not candidate.is_absolute():
            candidate = cwd / candidate
        return candidate.exists()
    except (OSError, ValueError, RuntimeError):  # too long, bad bytes, no home directory
        return False


def candidates(text: str) -> list[str]:
    """The words of ``text`` that look like paths, in order, each once (bounded)."""
    found: list[str] = []
    for match in _WORDS.finditer(text[:MAX_SCANNED_CHARS]):
        quoted = match.group(1) or match.group(2)
        word = quoted if quoted is not None else match.group(3).strip(_LEADING).rstrip(_TRAILING)
        if not word or not _looks_like_path(word):
            continue
        path = _as_path(word)
        if path is not None and path not in found:
            found.append(path)
            if len(found) >= MAX_CANDIDATES:
                break
    return found


def named_paths(
    text: str, cwd: Path | None = None, exists: Callable[[str, Path], bool] = _exists
) -> list[str]:
    """The paths in ``text`` that name existing files or folders (relative ones from
    ``cwd``), in the order typed, at most ``MAX_OFFERED``."""
    base = Path.cwd() if cwd is None else cwd
    named = [path for path in candidates(text) if exists(path, base)]
    return named[:MAX_OFFERED]


def resolved(path: str, cwd: Path | None = None) -> str:
    """A named path as the attachment reads it (``~`` expanded, relative to ``cwd``)."""
    candidate = Path(path).expanduser()
    if not candidate.is_absolute():
        candidate = (Path.cwd() if cwd is None else cwd) / candidate
    return str(candidate)
