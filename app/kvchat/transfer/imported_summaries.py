"""The compaction summaries of a kvchat export or bundle (its ``summaries`` list), read as a
boundary: each is an object with ``after`` (the index in the file's ``messages`` of the last
message it stands for), ``text`` (storable text, not empty) and ``replaced_tokens`` (a count);
anything else is one line naming the file and the entry. Placed on the imported messages, so
a bundle of a compacted conversation resumes from its KV."""

from __future__ import annotations

from pathlib import Path

from kvchat.transfer.common import BadFile, ImportedSummary, check_text

# At most this many summaries a session (one per compaction).
MAX_SESSION_SUMMARIES = 10_000
# A summary's text, at most (the model writes a few hundred tokens; an edit may add some).
MAX_SUMMARY_CHARS = 1 << 20


def read_summaries(path: Path, value: object, kept: dict[int, int]) -> list[ImportedSummary]:
    """The ``summaries`` of an export (absent or null: none); ``kept`` maps the file's message
    indexes to the imported ones."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadFile(path, "summaries is not a list")
    if len(value) > MAX_SESSION_SUMMARIES:
        raise BadFile(path, f"{len(value):,} summaries is over the {MAX_SESSION_SUMMARIES:,} limit")
    summaries: list[ImportedSummary] = []
    for index, item in enumerate(value):
        where = f"summaries[{index}]"
        if not isinstance(item, dict):
            raise BadFile(path, f"{where} is not an object")
        after = item.get("after")
        if not isinstance(after, int) or isinstance(after, bool) or after not in kept:
            raise BadFile(path, f"{where}.after names no message of the export")
        text = check_text(path, item.get("text"), f"{where}.text")
        assert text is not None
        if not text.strip():
            raise BadFile(path, f"{where}.text is empty")
        if len(text) > MAX_SUMMARY_CHARS:
            raise BadFile(path, f"{where}.text is over {MAX_SUMMARY_CHARS:,} characters")
        replaced = item.get("replaced_tokens", 0)
        if (
            not isinstance(replaced, int)
            or isinstance(replaced, bool)
            or not 0 <= replaced < 1 << 31
        ):
            raise BadFile(path, f"{where}.replaced_tokens is not a count of tokens")
        summaries.append(ImportedSummary(kept[after], text, replaced))
    return summaries
