"""The document library's store side: a document is kept with its reading in one
transaction, found by name or id prefix, and its reading is pinned (the disk budget never
evicts it) until the document leaves the library; then it is evicted like any snapshot.
Model-free: snapshots of a synthetic seq state (tests/unit/kvcache/test_kvcache_safety.py)."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store
from kvchat.store.documents_sql import DocumentRow, LibraryReading
from tests.unit.kvcache.test_kvcache_safety import FP, FakeEngine, open_store, tokens_of

READING = "ab" * 12  # a reading's snapshot row: 24 hex digits


def document(name: str = "valves.txt", text: str = "Item 1: the red valve.") -> DocumentRow:
    sha = f"{abs(hash(text)):064x}"[-64:]
    return DocumentRow(DocumentRow.key(name, sha), name, "text", len(text), sha, text)


def pin(doc: DocumentRow, reading: str = READING) -> LibraryReading:
    return LibraryReading(doc.id, reading, "m.gguf", "f16", 40, "")


def test_a_document_is_kept_with_its_reading_and_found_by_name_or_id(tmp_path: Path) -> None:
    store = Store(tmp_path / "kvchat.db")
    doc = document()
    store.add_to_library(doc, pin(doc))
    (kept,) = store.documents(library=True)
    assert kept.id == doc.id and kept.in_library and kept.text == doc.text
    assert store.library_document("valves.txt") == kept
    assert store.library_document(doc.id[:8]) == kept
    assert store.library_document(doc.id[:5]) is None  # too short to be an id
    assert store.library_document("other.txt") is None
    (reading,) = store.library_readings(doc.id)
    assert (reading.reading_id, reading.model, reading.kv_type, reading.tokens) == (
        READING,
        "m.gguf",
        "f16",
        40,
    )
    assert store.pinned_sessions() == {READING}


def test_removing_un_pins_and_keeps_the_text_for_conversations(tmp_path: Path) -> None:
    store = Store(tmp_path / "kvchat.db")
    doc = document()
    store.add_to_library(doc, pin(doc))
    session = store.create_session("about valves").id
    store.attach_documents(session, [doc.id])
    assert store.document_use() == {doc.id: 1}
    assert store.remove_from_library(doc.id) == [READING]
    assert store.pinned_sessions() == set() and store.library_readings() == []
    assert store.documents(library=True) == []
    (used,) = store.session_documents(session)
    assert used.document.text == doc.text  # the conversation keeps what it was given
    assert store.library_document("valves.txt") is None


def test_a_failed_add_stores_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "kvchat.db")
    doc = document()
    store.conn.execute(  # a reading table that refuses the row: the document goes too
        "CREATE TRIGGER refuse BEFORE INSERT ON library_readings BEGIN"
        " SELECT RAISE(ABORT, 'refused'); END"
    )
    with pytest.raises((KvchatError, sqlite3.Error)):
        store.add_to_library(doc, pin(doc))
    assert store.documents() == [] and store.library_readings() == []


def test_the_disk_budget_keeps_a_pinned_reading_and_evicts_it_once_removed(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    store, snapshots = open_store(home)
    # The reading is saved first: the least recently used, the first a budget would evict.
    store.ensure_reading(READING, "Reading of valves.txt")
    snapshots.save(READING, FakeEngine(tokens_of(0), seed=0), FP)
    others = []
    for seed in (1, 2):
        session = store.create_session(f"s{seed}").id
        snapshots.save(session, FakeEngine(tokens_of(seed), seed=seed), FP)
        others.append(session)
    doc = document()
    store.add_to_library(doc, pin(doc))
    reading_bytes = snapshots.snapshot_bytes(READING)
    assert 0 < reading_bytes < snapshots.disk_bytes()

    snapshots.budget_bytes = reading_bytes  # room for one snapshot: the reading's
    assert snapshots.enforce_budget() == others
    assert store.get_snapshot(READING) is not None
    assert snapshots.disk_bytes() == reading_bytes

    assert snapshots.over_budget_note() is None

    snapshots.budget_bytes = 1  # no room at all: a pinned reading stays even so
    assert snapshots.enforce_budget() == []
    assert store.get_snapshot(READING) is not None
    note = snapshots.over_budget_note()
    assert note is not None and "the document library's readings use" in note
    assert "kvchat docs rm" in note

    store.remove_from_library(doc.id)
    assert snapshots.enforce_budget() == [READING]
    assert store.get_snapshot(READING) is None and snapshots.disk_bytes() == 0


def test_a_library_document_keeps_the_path_it_was_added_from(tmp_path: Path) -> None:
    store = Store(tmp_path / "kvchat.db")
    doc = document()
    store.add_to_library(replace(doc, source="/home/me/valves.txt", in_library=True), pin(doc))
    store.put_documents([replace(doc, source="valves.txt")])  # attached later, elsewhere
    kept = store.library_document("valves.txt")
    assert kept is not None and kept.source == "/home/me/valves.txt" and kept.in_library
    loose = document("other.txt")
    store.put_documents([replace(loose, source="a/other.txt")])
    store.put_documents([replace(loose, source="b/other.txt")])
    (row,) = [d for d in store.documents() if d.id == loose.id]
    assert row.source == "b/other.txt"  # an attachment shows where it was last read from
