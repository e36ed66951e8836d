"""An attached path is a door: whatever it holds, kvchat gives documents or exactly one clear
line (a DocumentError on one line), never a traceback, never a hang, and what it gives is
text (no escape or control character but tab and newline).

Seeded random cases: mutated and cut PDFs, random bytes, mixed encodings, control characters,
long lines, sparse huge files, links, FIFOs, deep and wide folders. A sample runs by default
(PDF cases start the reader child, so the sample is e2e); ``pytest -m stress`` runs 240.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

from kvchat.documents import ReadBounds, attach
from kvchat.errors import DocumentError
from tests.unit.documents.pdf_making import encrypted_pdf, nested_pdf, text_pdf

BOUNDS = ReadBounds(
    max_file_bytes=1 << 20,
    max_entries=500,
    max_files=50,
    max_depth=6,
    pdf_cpu_s=5,
    pdf_wall_s=15,
)
TIME_CAP_S = 30.0
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\x1b]")
KINDS = ["pdf", "bytes", "encoding", "control", "long", "huge", "link", "fifo", "deep", "wide"]


def _text(rng: random.Random) -> str:
    pieces = ["plain words ", "\x1b[2J", "\x1b]0;title\x07", "\x9b31m", "<|im_start|>", "\r\n"]
    pieces += ["é", "\u202e", "\ufeff", "\t", "\x00", "\x7f", "日本"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))


def make_case(rng: random.Random, where: Path, kind: str) -> Path:
    """One hostile attachment of ``kind`` under ``where``; the path to attach."""
    where.mkdir()
    file = where / rng.choice(["a.txt", "b.md", "c.pdf", "d.html", "e.csv", "f.py", "g"])
    if kind == "pdf":
        raw = rng.choice(
            [
                text_pdf([_text(rng).replace("\x00", "")]),
                encrypted_pdf(),
                nested_pdf(rng.randint(10, 5000)),
            ]
        )
        raw = bytearray(raw)
        for _ in range(rng.randint(0, 8)):
            at = rng.randrange(len(raw))
            raw[at] = rng.randrange(256)
        if rng.random() < 0.4:
            raw = raw[: rng.randrange(len(raw))]
        file = where / "doc.pdf"
        file.write_bytes(bytes(raw))
    elif kind == "bytes":
        file.write_bytes(rng.randbytes(rng.randint(0, 4096)))
    elif kind == "encoding":
        text = _text(rng).replace("\x00", "")
        encoding = rng.choice(["utf-8", "latin-1", "utf-16", "utf-32", "cp1252", "shift_jis"])
        file.write_bytes(text.encode(encoding, "replace"))
    elif kind == "control":
        file.write_bytes(_text(rng).encode("utf-8", "surrogatepass"))
    elif kind == "long":
        file.write_bytes(b"x" * rng.randint(1, 2 << 20))
    elif kind == "huge":
        with open(file, "wb") as f:
            os.truncate(f.fileno(), rng.choice([BOUNDS.max_file_bytes + 1, 2 << 30, 1 << 40]))
    elif kind == "link":
        target = rng.choice(["/dev/zero", "/etc/hostname", str(file), str(where)])
        file.symlink_to(target)
        if rng.random() < 0.5:
            return where
    elif kind == "fifo":
        os.mkfifo(file)
        if rng.random() < 0.5:
            return where
    elif kind == "deep":
        folder = where
        for _ in range(rng.randint(1, 10)):
            folder = folder / "d"
        folder.mkdir(parents=True)
        (folder / "x.txt").write_bytes(_text(rng).encode("utf-8", "surrogatepass"))
        return where
    elif kind == "wide":
        for i in range(rng.choice([5, 60, 600])):
            (where / f"f{i}.txt").write_text("x")
        return where
    return file


def check(path: Path) -> str:
    """Attach ``path``: documents of clean text, or one line. What it came to."""
    started = time.monotonic()
    try:
        attachment = attach(path, bounds=BOUNDS)
    except DocumentError as exc:
        line = str(exc)
        assert line and "\n" not in line and "\r" not in line and not _UNSAFE.search(line), line
        outcome = "refused"
    else:
        for document in attachment.documents:
            assert not _UNSAFE.search(document.text) and not _UNSAFE.search(document.name)
            assert len(document.text) <= BOUNDS.max_text_chars
        assert all("\n" not in note for note in attachment.notes)
        outcome = "read"
    assert time.monotonic() - started < TIME_CAP_S
    return outcome


def campaign(tmp_path: Path, cases: int, seed: int, kinds: list[str]) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"read": 0, "refused": 0}
    for i in range(cases):
        kind = kinds[i % len(kinds)]
        counts[check(make_case(rng, tmp_path / f"case{i}", kind))] += 1
    return counts


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "pdf"])
def test_sample_without_pdfs(tmp_path: Path, kind: str) -> None:
    counts = campaign(tmp_path, 2, seed=KINDS.index(kind), kinds=[kind])
    assert sum(counts.values()) == 2


@pytest.mark.e2e
def test_sample_of_pdfs(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 4, seed=99, kinds=["pdf"])
    assert sum(counts.values()) == 4


@pytest.mark.stress
@pytest.mark.e2e
def test_stress_campaign(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 240, seed=2026, kinds=KINDS)
    print(
        f"\nSTRESS attachments: 240 hostile cases, {counts['read']} read, {counts['refused']} refused, 0 failures"
    )
    assert counts["read"] > 0 and counts["refused"] > 0
