"""A folder → its documents: walked in sorted order, bounded, and as git would see it.

What is walked: every entry but hidden ones (``.git``, ``.venv``, ``.env``…) and those that a
``.gitignore`` of the folder or of a folder inside it ignores (gitignore rules through
pathspec, the deeper file winning as in git); ``glob`` (gitignore pattern syntax: ``*.py``
matches at any depth, ``docs/*.md`` under ``docs/`` only, ``**/*.md`` anywhere) picks files.

What is refused, whole, with one line: more entries looked at than ``max_entries`` (counted
while listing, so a folder of 50,000 files fails fast), more matching files than
``max_files``, more bytes than ``max_total_bytes`` (before any is read), folders deeper
than ``max_depth``, more text than ``max_total_text_chars``.

What is skipped with a note, never followed: links of any kind (so no link leads out of the
folder, and no link loop is walked), FIFOs, devices and sockets; and a file that kvchat will
not read (binary, not UTF-8, a PDF without text…) is a note too, so one stray image does not
refuse a source tree.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.documents.bounds import MAX_IGNORE_FILE_BYTES, ReadBounds
from kvchat.documents.document import Attachment, canonical_order, display_name, refuse
from kvchat.documents.reading import open_problem, read_bytes, read_document
from kvchat.errors import DocumentError
from kvchat.paths import file_kind
from kvchat.units import human_bytes

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec

IGNORE_FILE = ".gitignore"


@dataclass(frozen=True)
class _Rules:
    """A .gitignore's patterns and the folder (parts relative to the root) it sits in."""

    base: tuple[str, ...]
    spec: GitIgnoreSpec


@dataclass(frozen=True)
class _Found:
    path: Path
    name: str
    size: int


def read_folder(root: Path, *, glob: str | None, bounds: ReadBounds) -> Attachment:
    """The documents of the folder ``root`` whose files match ``glob`` (all, when None)."""
    picks = _glob_spec(glob)
    notes: list[str] = []
    found = _walk(root, picks, bounds, notes)
    if not found:
        what = f"no file matching {glob!r}" if glob else "no file kvchat reads"
        raise refuse(str(root), f"has {what}" + (f" ({len(notes)} skipped)" if notes else ""))
    total = sum(f.size for f in found)
    if total > bounds.max_total_bytes:
        raise refuse(
            str(root),
            f"has {human_bytes(total)} in {len(found):,} files; the limit is "
            f"{human_bytes(bounds.max_total_bytes)} (pick fewer with a glob or .gitignore)",
        )
    documents = []
    chars = 0
    for item in found:
        try:
            document = read_document(item.path, name=item.name, bounds=bounds, follow_links=False)
        except DocumentError as exc:
            notes.append(f"skipped {exc}")
            continue
        chars += len(document.text)
        if chars > bounds.max_total_text_chars:
            raise refuse(
                str(root),
                f"gives over {bounds.max_total_text_chars:,} characters of text; that is "
                "the limit (pick fewer files with a glob or .gitignore)",
            )
        documents.append(document)
    if not documents:
        raise refuse(str(root), f"has no file kvchat reads ({len(notes)} skipped)")
    return Attachment(canonical_order(documents), tuple(notes))


def _gitignore_spec(lines: Sequence[str]) -> GitIgnoreSpec:
    # Imported here: every kvchat command imports this module, few read a folder.
    from pathspec import GitIgnoreSpec

    return GitIgnoreSpec.from_lines(lines)


def _glob_spec(glob: str | None) -> GitIgnoreSpec | None:
    if glob is None:
        return None
    if not glob.strip() or "\n" in glob or "\0" in glob:
        raise DocumentError(f"the glob {display_name(glob)!r} is empty or not one pattern")
    try:
        return _gitignore_spec([glob])
    except (ValueError, TypeError) as exc:
        raise DocumentError(f"the glob {display_name(glob)!r} is not valid ({exc})") from None


def _walk(
    root: Path, picks: GitIgnoreSpec | None, bounds: ReadBounds, notes: list[str]
) -> list[_Found]:
    """The files to read under ``root``, in sorted order (depth first, names sorted)."""
    found: list[_Found] = []
    seen = 0
    stack: list[tuple[Path, tuple[str, ...], tuple[_Rules, ...]]] = [(root, (), ())]
    while stack:
        folder, parts, rules = stack.pop()
        if len(parts) > bounds.max_depth:
            raise refuse(
                str(root), f"has folders deeper than {bounds.max_depth} levels (the limit)"
            )
        entries, seen = _list(root, folder, parts, seen, bounds)
        names = {entry.name for entry in entries}
        if IGNORE_FILE in names:
            own = _ignore_rules(folder / IGNORE_FILE, parts, notes)
            rules = (*rules, own) if own else rules
        folders: list[tuple[Path, tuple[str, ...], tuple[_Rules, ...]]] = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            here = (*parts, entry.name)
            name = "/".join(here)
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                notes.append(f"skipped {display_name(name)}: {open_problem(exc)}")
                continue
            is_dir = stat.S_ISDIR(mode)
            if _ignored(rules, here, is_dir):
                continue
            if is_dir:
                folders.append((Path(entry.path), here, rules))
                continue
            if picks is not None and not picks.match_file(name):
                continue
            if stat.S_ISLNK(mode):
                notes.append(f"skipped {display_name(name)}: a link (links are not followed)")
            elif not stat.S_ISREG(mode):
                notes.append(f"skipped {display_name(name)}: {file_kind(mode)}")
            else:
                found.append(
                    _Found(Path(entry.path), name, entry.stat(follow_symlinks=False).st_size)
                )
                if len(found) > bounds.max_files:
                    raise refuse(
                        str(root),
                        f"has over {bounds.max_files:,} files to read; the limit is "
                        f"{bounds.max_files:,} (pick fewer with a glob or .gitignore)",
                    )
        stack.extend(reversed(folders))
    return found


def _list(
    root: Path, folder: Path, parts: tuple[str, ...], seen: int, bounds: ReadBounds
) -> tuple[list[os.DirEntry[str]], int]:
    """The entries of ``folder`` sorted by name; counted against ``max_entries`` as they are
    listed, so a huge folder is refused before it is listed whole."""
    entries: list[os.DirEntry[str]] = []
    try:
        with os.scandir(folder) as listing:
            for entry in listing:
                seen += 1
                if seen > bounds.max_entries:
                    raise refuse(
                        str(root),
                        f"has over {bounds.max_entries:,} files and folders; the limit is "
                        f"{bounds.max_entries:,} (attach a smaller folder)",
                    )
                entries.append(entry)
    except OSError as exc:
        name = "/".join(parts) or str(root)
        raise refuse(name, open_problem(exc)) from None
    entries.sort(key=lambda entry: entry.name)
    return entries, seen


def _ignore_rules(path: Path, parts: tuple[str, ...], notes: list[str]) -> _Rules | None:
    """The rules of the .gitignore at ``path`` (a link or a bad file is a note, no rules)."""
    name = "/".join((*parts, IGNORE_FILE))
    try:
        raw = read_bytes(path, name, MAX_IGNORE_FILE_BYTES, follow_links=False)
    except DocumentError as exc:
        notes.append(f"not used: {exc}")
        return None
    lines = raw.decode("utf-8", "replace").splitlines()
    try:
        return _Rules(parts, _gitignore_spec(lines))
    except (ValueError, TypeError) as exc:
        notes.append(f"not used: {display_name(name)}: {exc}")
        return None


def _ignored(rules: Sequence[_Rules], parts: tuple[str, ...], is_dir: bool) -> bool:
    """Whether git would ignore ``parts``: the deepest .gitignore that says anything wins."""
    ignored = False
    for rule in rules:
        relative = "/".join(parts[len(rule.base) :]) + ("/" if is_dir else "")
        verdict = rule.spec.check_file(relative).include
        if verdict is not None:
            ignored = verdict
    return ignored
