"""Paths typed or pasted into a message: which words name existing files or folders (offered
as attachments, never attached by themselves), and the app's lines about attachments."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvchat.tui.main.attachments import changed_names, later_line, turn_line
from kvchat.tui.pasted_paths import MAX_OFFERED, candidates, named_paths, resolved


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("n\n")
    (tmp_path / "My File.md").write_text("m\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print()\n")
    return tmp_path


def test_existing_paths_in_a_message_are_found_in_order(tree: Path) -> None:
    text = (
        f"Compare {tree / 'src' / 'main.py'}, ./notes.txt and '{tree / 'My File.md'}' "
        f"with src/ (and {tree / 'missing.txt'})."
    )
    assert named_paths(text, tree) == [
        str(tree / "src" / "main.py"),
        "./notes.txt",
        str(tree / "My File.md"),
        "src/",
    ]


def test_a_dropped_file_uri_is_a_path(tree: Path) -> None:
    uri = "file://" + str(tree / "My File.md").replace(" ", "%20")
    assert named_paths(f"look at {uri}", tree) == [str(tree / "My File.md")]
    assert named_paths("file://elsewhere.example/etc/hosts", tree) == []


def test_words_that_only_look_like_paths_are_not_offered(tree: Path) -> None:
    assert named_paths("What is 2+2? Say hello. e.g. i.e. and/or", tree) == []
    assert named_paths("notes", tree) == []  # no separator, no extension: a word
    assert candidates("and/or x.y") == ["and/or", "x.y"]  # looked at, then not found


def test_relative_paths_resolve_from_the_working_directory(tree: Path) -> None:
    assert resolved("notes.txt", tree) == str(tree / "notes.txt")
    assert resolved(str(tree / "src"), Path("/elsewhere")) == str(tree / "src")


def test_hostile_text_never_raises_and_stays_bounded(tree: Path) -> None:
    """240 seeded messages: controls, NULs, quotes, long runs, odd URIs and real paths mixed
    in; the answer is always a bounded list of paths that exist."""
    rng = random.Random(39)
    pieces = [
        "\x00",
        "\x1b[31m",
        "'",
        '"',
        "~/",
        "../" * 50,
        "file://",
        "file:///%00",
        "%ff%fe",
        "/" + "a" * 5000,
        "x." + "y" * 20,
        "\u202e",
        "\ud800",
        "./notes.txt",
        str(tree / "src"),
        "é/ü.txt",
        " ",
        "\n",
        ",.;:!?)",
    ]
    for _ in range(240):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        found = named_paths(text, tree)
        assert len(found) <= MAX_OFFERED
        for path in found:
            assert Path(resolved(path, tree)).exists()


def test_many_paths_are_offered_at_most_a_few(tree: Path) -> None:
    text = " ".join(
        ["./notes.txt", "src/main.py"] * 40 + [f"./src/../notes.txt#{i}" for i in range(40)]
    )
    assert named_paths(text, tree) == ["./notes.txt", "src/main.py"]
    many = " ".join(f"./src/{'./' * i}main.py" for i in range(20))
    assert len(named_paths(many, tree)) == MAX_OFFERED


def _used(name: str, sha: str, source: str = "") -> SimpleNamespace:
    return SimpleNamespace(document=SimpleNamespace(name=name, sha256=sha, source=source))


def test_a_changed_file_is_named_by_name_or_source() -> None:
    stored = [_used("a.txt", "1" * 64, "/d/a.txt"), _used("b.txt", "2" * 64)]
    read = SimpleNamespace(
        rows=(
            SimpleNamespace(name="a.txt", sha256="9" * 64, source="/d/a.txt"),
            SimpleNamespace(name="b.txt", sha256="2" * 64, source="/d/b.txt"),
            SimpleNamespace(name="c.txt", sha256="3" * 64, source="/d/c.txt"),
        )
    )
    assert changed_names(stored, read) == ["a.txt"]  # type: ignore[arg-type]


def test_the_lines_say_the_figures_and_where_the_documents_went() -> None:
    fit = SimpleNamespace(tokens=1_234, n_ctx=4_096, seconds=6.4, share=1_234 / 4_096)
    assert later_line(fit) == (  # type: ignore[arg-type]
        "1,234 tokens, 30% of the context (4,096), about 6 s to read here; "
        "read once for this conversation"
    )
    tokens = SimpleNamespace(reused=572, decoded=17)
    restored = SimpleNamespace(donor="abc", tokens=572)
    report = SimpleNamespace(tokens=tokens, restore=restored)
    assert turn_line(report, True) == (  # type: ignore[arg-type]
        "last turn: 572 tokens reused, 17 decoded · the documents were restored "
        "(572 tokens read by an earlier conversation)"
    )
    first = SimpleNamespace(tokens=tokens, restore=SimpleNamespace(donor=None, tokens=0))
    assert turn_line(first, True).endswith("read once for all conversations started with them")  # type: ignore[arg-type]
    assert turn_line(first, False).endswith("read once for this conversation")  # type: ignore[arg-type]
    assert turn_line(first, None) == "last turn: 572 tokens reused, 17 decoded"  # type: ignore[arg-type]
