"""Session tags: what a user types (``work #rust, ideas``) parsed once into a bounded tuple
of lowercase words, and the form the ``tags`` column keeps them in (space-separated)."""

from __future__ import annotations

import re

from kvchat.errors import KvchatError

MAX_TAGS = 8
MAX_TAG_CHARS = 32
# Letters, digits, "-" and "_" (any script): no space, "#", quote or control character.
_TAG = re.compile(r"\w[\w-]*")


def parse_tags(text: str) -> tuple[str, ...]:
    """The tags in ``text`` (separated by spaces or commas, each with or without a leading
    ``#``), lowercased, in order, each once; a word that is not a tag is one clear error."""
    out: list[str] = []
    for word in re.split(r"[\s,]+", text.strip()):
        tag = word.removeprefix("#").casefold()
        if not tag:
            continue
        if len(tag) > MAX_TAG_CHARS or not _TAG.fullmatch(tag):
            shown = tag[:MAX_TAG_CHARS].encode("unicode_escape").decode("ascii")
            shown += "…" if len(tag) > MAX_TAG_CHARS else ""
            raise KvchatError(
                f"{shown} is not a tag: a tag is one "
                f"word of letters, digits, - or _ ({MAX_TAG_CHARS} characters at most)"
            )
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise KvchatError(f"at most {MAX_TAGS} tags a session ({len(out)} given)")
    return tuple(out)


def stored_tags(column: object) -> tuple[str, ...]:
    """The tags a ``tags`` column holds; anything that does not parse (not written by
    kvchat) reads as no tags."""
    if not isinstance(column, str) or not column:
        return ()
    try:
        return parse_tags(column)
    except KvchatError:
        return ()


def column_text(tags: tuple[str, ...]) -> str:
    """The ``tags`` column's text for ``tags`` (already parsed)."""
    return " ".join(tags)


def tags_text(tags: tuple[str, ...]) -> str:
    """Tags as a person reads them: ``#work #rust``."""
    return " ".join(f"#{t}" for t in tags)
