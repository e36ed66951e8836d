"""A PDF made in the test (a real text layer, two pages) attaches with ``kvchat ask -a``: the
model reads its text (kept in SQLite with its page count), the turn answers, and a second
conversation about it restores the first one's reading and decodes only its question, with
the greedy reply a full prefill gives."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.unit.documents.pdf_making import text_pdf

FLAGS = ["--temperature", "0", "--max-tokens", "16", "--json"]
PAGES = [
    "Pump station manual\nThe red pump in hall 3 starts at 40 kPa.\nThe blue pump in hall 5 "
    "starts at 55 kPa.",
    "Maintenance\nThe red pump is serviced every 6 weeks.\nThe blue pump is serviced every "
    "9 weeks.\nCall extension 2214 for help.",
]


def test_a_pdf_attaches_and_the_answer_turn_runs(
    kvhome: Path, cli, copy_home, tmp_path: Path
) -> None:
    pdf = tmp_path / "pumps.pdf"
    pdf.write_bytes(text_pdf(PAGES))
    first = cli(kvhome, "ask", "--new", "-a", str(pdf), "When does the red pump start?", *FLAGS)
    report = first.json
    (document,) = report["documents"]
    assert (document["name"], document["kind"], document["pages"]) == ("pumps.pdf", "pdf", 2)
    assert document["size"] == pdf.stat().st_size and document["tokens"] > 40
    assert report["tokens"]["prompt"] > document["tokens"]
    assert report["tokens"]["generated"] > 0 and report["message_id"] is not None
    with sqlite3.connect(kvhome / "kvchat.db") as db:
        ((text, pages),) = db.execute("SELECT text, pages FROM documents").fetchall()
    assert pages == 2
    for line in (*PAGES[0].splitlines(), *PAGES[1].splitlines()):
        assert line in text  # the text layer, page by page

    baseline_home = copy_home(kvhome, "baseline")
    question = "How often is the blue pump serviced?"
    second = cli(kvhome, "ask", "--new", "-a", str(pdf), question, *FLAGS).json
    baseline = cli(baseline_home, "ask", "--new", "-a", str(pdf), question, "--no-restore", *FLAGS)
    assert second["restore"]["from"] == "disk" and second["restore"]["tokens"] > 40
    assert second["tokens"]["reused"] == second["restore"]["tokens"]
    assert second["tokens"]["decoded"] == second["tokens"]["prompt"] - second["tokens"]["reused"]
    assert second["tokens"]["decoded"] < 24
    assert second["reply"] == baseline.json["reply"]
