"""``kvchat docs`` without a model: the listing's figures and file notes (a file changed or
gone since it was read: the stored text stays the truth), and every refusal one line with
nothing stored. In-process."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import Settings
from kvchat.service.chat import ChatService
from kvchat.store.documents_sql import DocumentRow, LibraryReading


def keep(home: Path, path: Path, *, conversations: int = 0) -> DocumentRow:
    """Put the file at ``path`` in the library as read now, with a reading, and start
    ``conversations`` sessions with it."""
    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    row = DocumentRow(
        DocumentRow.key(path.name, sha),
        path.name,
        "text",
        len(raw),
        sha,
        raw.decode(),
        None,
        str(path),
    )
    service = ChatService(Settings(), home=home)
    try:
        service.store.add_to_library(
            row, LibraryReading(row.id, "ab" * 12, "m.gguf", "q8_0", 99, "")
        )
        for n in range(conversations):
            session = service.store.create_session(f"about it {n}").id
            service.store.attach_documents(session, [row.id])
    finally:
        service.close()
    return row


def run(home: Path, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, list(args), env={"KVCHAT_HOME": str(home)})


def test_an_empty_library_says_so(kvhome: Path) -> None:
    listed = run(kvhome, "docs", "list")
    assert (
        listed.exit_code == 0
        and listed.stdout == "no documents in the library (kvchat docs add PATH)\n"
    )
    assert run(kvhome, "docs", "list", "--json").stdout == '{"documents": []}\n'


def test_the_listing_shows_figures_and_a_file_changed_or_gone(kvhome: Path, tmp_path: Path) -> None:
    same, changed, gone = (tmp_path / f"{n}.txt" for n in ("same", "changed", "gone"))
    for path in (same, changed, gone):
        path.write_text(f"The text of {path.name}.\n")
    rows = {
        p.name: keep(kvhome, p, conversations=2 if p == same else 0) for p in (same, changed, gone)
    }
    changed.write_text("A new version.\n")
    gone.unlink()

    listed = run(kvhome, "docs", "list", "--json")
    assert listed.exit_code == 0, listed.output
    entries = {e["name"]: e for e in json.loads(listed.stdout)["documents"]}
    assert {n: e["file"] for n, e in entries.items()} == {
        "same.txt": None,
        "changed.txt": "changed on disk",
        "gone.txt": "gone from disk",
    }
    same_entry = entries["same.txt"]
    assert same_entry["conversations"] == 2 and same_entry["tokens"] == 99
    assert same_entry["id"] == rows["same.txt"].id
    (reading,) = same_entry["readings"]
    assert (reading["model"], reading["kv_type"], reading["on_disk"]) == ("m.gguf", "q8_0", False)

    text = run(kvhome, "docs", "list").stdout
    assert "same.txt  text  99 tokens  0 B KV on disk  2 conversations" in text
    assert "read with m.gguf, q8_0 KV  (its KV is not on disk: read again)" in text
    assert (
        f"changed on disk: conversations keep the text it was read with; kvchat docs add "
        f"{changed} reads the new version"
    ) in text


def test_refusals_are_one_line_and_store_nothing(kvhome: Path, tmp_path: Path) -> None:
    cases = [
        (["docs", "add", str(tmp_path / "missing.txt")], "missing.txt"),
        (["docs", "rm", "nothing.txt"], "no document 'nothing.txt' in the library"),
        (["ask", "-a", str(tmp_path), "--doc", "x", "Hi"], "use either --attach or --doc"),
        (["ask", "--continue", "--session", "s1", "--doc", "x"], "--continue goes on inside"),
    ]
    for args, said in cases:
        result = run(kvhome, *args)
        assert result.exit_code == 2, (args, result.output)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("kvchat: ") and said in line, line
    assert run(kvhome, "docs", "list", "--json").stdout == '{"documents": []}\n'
