"""The name a user gives ``kvchat docs rm`` (and ``ask --doc``) is a door: whatever it is
(escapes, control characters, lone surrogates, SQL and LIKE wildcards, quotes, id-like hex,
megabyte strings), kvchat removes the library document of exactly that name or id, or says
in one line that there is none; never a traceback, never another document removed, never a
raw escape in what it prints. The library's listing of documents with hostile file names
stays one clean line per field. Seeded cases in-process (no model); a 20-case sample runs
by default, ``pytest -m stress`` runs 240.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import Settings
from kvchat.documents.document import display_name
from kvchat.service.chat import ChatService
from kvchat.store.documents_sql import DocumentRow, LibraryReading

_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_PIECES = [
    "valves",
    ".txt",
    "\x1b[2J",
    "\x1b]0;title\x07",
    "\x9b31m",
    "%",
    "_",
    "*",
    "'",
    '"',
    "; DROP TABLE documents; --",
    "\udcff",
    "\x00",
    "\r\n",
    "\t",
    "é",
    "\u202e",
    "日本",
    " ",
]


def hostile(rng: random.Random) -> str:
    """A name a user might type, or a hostile one."""
    roll = rng.random()
    if roll < 0.1:
        return rng.choice("0123456789abcdef") * rng.randint(1, 40)  # id-like hex
    if roll < 0.15:
        return "x" * rng.randint(10_000, 1_000_000)
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12)))


def library(home: Path, rng: random.Random, count: int) -> list[DocumentRow]:
    """A library of ``count`` documents whose names come from hostile file names (as the
    reader shows them: display_name), each with a pinned reading."""
    service = ChatService(Settings(), home=home)
    rows = []
    try:
        for index in range(count):
            name = display_name(hostile(rng).replace("\x00", "") or "empty")[:200]
            sha = f"{index:064x}"
            row = DocumentRow(DocumentRow.key(name, sha), name, "text", 5, sha, f"text {index}")
            reading = LibraryReading(row.id, f"{index:024x}", "m.gguf", "f16", 40, "")
            service.store.add_to_library(row, reading)
            rows.append(row)
    finally:
        service.close()
    return rows


def one_line_out(text: str) -> None:
    assert text.count("\n") <= 1 and not _UNSAFE.search(text.rstrip("\n")), repr(text[:200])


def campaign(home: Path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    kept = library(home, rng, 6)
    runner = CliRunner()
    counts = {"removed": 0, "refused": 0}
    for _ in range(cases):
        # A name in the library (exactly, or its id's prefix) now and then, else hostile.
        roll = rng.random()
        if roll < 0.1 and kept:
            ref = rng.choice(kept).name
        elif roll < 0.15 and kept:
            ref = rng.choice(kept).id[: rng.randint(6, 32)]
        else:
            ref = hostile(rng)
        before = {row.id for row in kept}
        result = runner.invoke(main, ["docs", "rm", ref], env={"KVCHAT_HOME": str(home)})
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            result.exception
        )
        service = ChatService(Settings(), home=home)
        try:
            left = {row.id for row in service.store.documents(library=True)}
            pinned = service.store.pinned_sessions()
        finally:
            service.close()
        if result.exit_code == 0:
            gone = before - left
            assert len(gone) == 1, (ref, gone)
            (removed,) = [row for row in kept if row.id in gone]
            assert removed.name == ref or removed.id.startswith(ref)
            assert result.stdout.startswith(f"removed {removed.name} from the library")
            one_line_out(result.stdout)
            kept = [row for row in kept if row.id in left]
            counts["removed"] += 1
        else:
            assert result.exit_code == 2 and left == before, (ref[:80], result.stdout)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("kvchat: "), lines
            one_line_out(result.stderr)
            counts["refused"] += 1
        assert len(pinned) == len(kept)  # a reading is pinned while its document is kept
        listed = runner.invoke(main, ["docs", "list"], env={"KVCHAT_HOME": str(home)})
        assert listed.exit_code == 0, listed.output
        for line in listed.stdout.splitlines():
            assert not _UNSAFE.search(line), repr(line)
        if not kept:
            kept = library(home, rng, 6)
    return counts


def test_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    counts = campaign(tmp_path / "home", 20, seed=7)
    assert sum(counts.values()) == 20


@pytest.mark.stress
def test_stress_campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    counts = campaign(tmp_path / "home", 240, seed=2026)
    print(
        f"\nSTRESS docs rm: 240 hostile names, {counts['removed']} removed, "
        f"{counts['refused']} refused, 0 failures"
    )
    assert counts["removed"] > 0 and counts["refused"] > 0
