"""A folder is walked as git sees it (its .gitignore files, no hidden folders), picked by a
glob, in one sorted order, never through a link, and bounded: too many entries, files, bytes
or levels is one line, found while walking, not after."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvchat.documents import ReadBounds, attach
from kvchat.errors import DocumentError


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def names(root: Path, glob: str | None = None, bounds: ReadBounds = ReadBounds()) -> list[str]:
    return [d.name for d in attach(root, glob=glob, bounds=bounds).documents]


def refusal(root: Path, bounds: ReadBounds, glob: str | None = None) -> str:
    started = time.monotonic()
    with pytest.raises(DocumentError) as caught:
        attach(root, glob=glob, bounds=bounds)
    assert time.monotonic() - started < 10
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_documents_are_named_by_their_path_inside_the_folder_in_sorted_order(
    tmp_path: Path,
) -> None:
    tree(tmp_path, {"z.md": "z", "a/b.txt": "b", "a/a.txt": "a", "m.py": "m"})
    assert names(tmp_path) == ["a/a.txt", "a/b.txt", "m.py", "z.md"]


def test_gitignore_files_are_obeyed_nested_ones_too(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            ".gitignore": "build/\n*.log\n",
            "build/out.txt": "x",
            "keep.txt": "k",
            "run.log": "l",
            "sub/.gitignore": "!important.log\nsecret.txt\n",
            "sub/important.log": "i",
            "sub/other.log": "o",
            "sub/secret.txt": "s",
            "sub/ok.txt": "ok",
        },
    )
    assert names(tmp_path) == ["keep.txt", "sub/important.log", "sub/ok.txt"]


def test_hidden_files_and_folders_are_not_read(tmp_path: Path) -> None:
    tree(tmp_path, {".git/config": "c", ".env": "SECRET=1", ".venv/x.py": "v", "a.txt": "a"})
    assert names(tmp_path) == ["a.txt"]


@pytest.mark.parametrize(
    ("glob", "expected"),
    [
        ("*.py", ["a.py", "src/b.py", "src/deep/c.py"]),
        ("src/*.py", ["src/b.py"]),
        ("**/*.md", ["docs/d.md", "r.md"]),
    ],
)
def test_a_glob_picks_files_with_gitignore_syntax(
    tmp_path: Path, glob: str, expected: list[str]
) -> None:
    tree(
        tmp_path,
        {"a.py": "", "src/b.py": "", "src/deep/c.py": "", "docs/d.md": "", "r.md": "", "x.txt": ""},
    )
    assert names(tmp_path, glob) == expected


def test_a_glob_that_matches_nothing_says_so(tmp_path: Path) -> None:
    tree(tmp_path, {"a.txt": "a"})
    assert refusal(tmp_path, ReadBounds(), glob="*.rs").endswith("has no file matching '*.rs'")


def test_links_are_skipped_with_a_note_never_followed_out_or_round(tmp_path: Path) -> None:
    outside = tree(tmp_path / "outside", {"secret.txt": "secret"})
    root = tree(tmp_path / "root", {"a.txt": "a"})
    (root / "out.txt").symlink_to(outside / "secret.txt")
    (root / "outdir").symlink_to(outside)
    (root / "up").symlink_to(root)  # a loop
    (root / "self").symlink_to(root / "self")  # a link to itself
    attachment = attach(root)
    assert [d.name for d in attachment.documents] == ["a.txt"]
    assert all("secret" not in d.text for d in attachment.documents)
    assert attachment.notes == tuple(
        f"skipped {name}: a link (links are not followed)"
        for name in ("out.txt", "outdir", "self", "up")
    )


def test_a_fifo_in_a_folder_is_skipped_without_blocking(tmp_path: Path) -> None:
    tree(tmp_path, {"a.txt": "a"})
    os.mkfifo(tmp_path / "pipe")
    attachment = attach(tmp_path)
    assert [d.name for d in attachment.documents] == ["a.txt"]
    assert attachment.notes == ("skipped pipe: a FIFO",)


def test_a_file_kvchat_will_not_read_is_a_note_not_a_refusal(tmp_path: Path) -> None:
    tree(tmp_path, {"a.txt": "a"})
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\0\0")
    (tmp_path / "old.txt").write_bytes(b"caf\xe9")
    attachment = attach(tmp_path)
    assert [d.name for d in attachment.documents] == ["a.txt"]
    assert [note.split(":")[0] for note in attachment.notes] == [
        "skipped logo.png",
        "skipped old.txt",
    ]


def test_too_many_entries_fail_fast_with_the_count(tmp_path: Path) -> None:
    for i in range(300):
        (tmp_path / f"f{i:04}.txt").write_text("x")
    line = refusal(tmp_path, ReadBounds(max_entries=200))
    assert line.endswith(
        "has over 200 files and folders; the limit is 200 (attach a smaller folder)"
    )


def test_ignored_entries_count_toward_the_entry_limit(tmp_path: Path) -> None:
    tree(tmp_path, {".gitignore": "junk/\n"})
    for i in range(50):
        tree(tmp_path, {f"junk{i}.log": "x"})
    assert "has over 40 files and folders" in refusal(tmp_path, ReadBounds(max_entries=40))


def test_too_many_matching_files_are_refused_with_the_limit(tmp_path: Path) -> None:
    for i in range(12):
        (tmp_path / f"f{i:02}.txt").write_text("x")
    line = refusal(tmp_path, ReadBounds(max_files=10))
    assert line.endswith(
        "has over 10 files to read; the limit is 10 (pick fewer with a glob or .gitignore)"
    )
    assert names(tmp_path, "f0*.txt", ReadBounds(max_files=10)) == [f"f0{i}.txt" for i in range(10)]


def test_too_many_bytes_together_are_refused_before_any_is_read(tmp_path: Path) -> None:
    tree(tmp_path, {"a.txt": "a" * 600, "b.txt": "b" * 600})
    line = refusal(tmp_path, ReadBounds(max_total_bytes=1000))
    assert line.endswith(
        "has 1.2 KiB in 2 files; the limit is 1,000 B (pick fewer with a glob or .gitignore)"
    )


def test_too_much_text_together_is_refused(tmp_path: Path) -> None:
    tree(tmp_path, {"a.txt": "a" * 600, "b.txt": "b" * 600})
    assert "gives over 1,000 characters of text" in refusal(
        tmp_path, ReadBounds(max_total_text_chars=1000)
    )


def test_folders_deeper_than_the_limit_are_refused(tmp_path: Path) -> None:
    tree(tmp_path, {"/".join(["d"] * 6) + "/a.txt": "a"})
    assert names(tmp_path, bounds=ReadBounds(max_depth=6)) == ["d/d/d/d/d/d/a.txt"]
    line = refusal(tmp_path, ReadBounds(max_depth=5))
    assert line.endswith("has folders deeper than 5 levels (the limit)")


def test_a_file_name_that_is_not_utf8_or_holds_escapes_is_shown_harmlessly(tmp_path: Path) -> None:
    (tmp_path / os.fsdecode(b"caf\xe9.txt")).write_text("x")
    (tmp_path / "red\x1b[31m.txt").write_text("y")
    assert names(tmp_path) == ["caf\\xe9.txt", "red.txt"]
