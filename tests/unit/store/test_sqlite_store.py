"""The SQLite store: migrations, sessions, messages, search, snapshot rows and reply
versions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store
from kvchat.store.migrations import MIGRATIONS


def test_migrations_on_an_empty_database_then_rerun(tmp_path: Path):
    path = tmp_path / "kv.db"
    store = Store(path)
    assert store.applied_migrations == [m.__name__ for m in MIGRATIONS]
    session = store.create_session("Keep me")
    store.add_message(session.id, "user", "hello there")
    store.close()

    again = Store(path)
    assert again.applied_migrations == []
    assert [m.content for m in again.messages(session.id)] == ["hello there"]
    again.close()

    db = sqlite3.connect(path)
    recorded = [r for (r,) in db.execute("SELECT name FROM _migrations ORDER BY name")]
    assert recorded == sorted(m.__name__ for m in MIGRATIONS)
    tables = {r for (r,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"sessions", "messages", "kv_snapshots", "messages_fts", "meta"} <= tables
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_an_interrupted_migration_runs_again(tmp_path: Path):
    path = tmp_path / "kv.db"
    Store(path).close()
    db = sqlite3.connect(path)
    with db:
        db.execute("DELETE FROM _migrations WHERE name = 'm003_kv_snapshots'")
    db.close()
    store = Store(path)
    assert store.applied_migrations == ["m003_kv_snapshots"]
    store.close()


def test_sessions_resolve_by_id_or_unique_title_prefix(tmp_path: Path):
    store = Store(tmp_path / "kv.db")
    rust = store.create_session("Rust lifetimes")
    store.create_session("Rust macros")
    poem = store.create_session("Poem about 100% cotton")
    assert store.resolve_session(rust.id) == rust
    assert store.resolve_session("rust l").id == rust.id
    assert store.resolve_session("Poem about 100%").id == poem.id
    with pytest.raises(KvchatError, match="matches 2 sessions"):
        store.resolve_session("Rust")
    with pytest.raises(KvchatError, match="no session matches"):
        store.resolve_session("Python")


def test_full_text_search_finds_messages_across_sessions(tmp_path: Path):
    store = Store(tmp_path / "kv.db")
    a = store.create_session("A")
    b = store.create_session("B")
    store.add_message(a.id, "user", "How do volcanoes erupt?")
    store.add_message(b.id, "assistant", "A volcano erupts when magma rises.")
    store.add_message(b.id, "user", "Tell me about glaciers")
    hits = store.search("volcano")
    assert {h.message.session_id for h in hits} == {a.id, b.id}  # porter stemming
    # Hits are marked with \x02…\x03, so a message's own brackets stay text.
    assert all("\x02" in h.snippet and "\x03" in h.snippet for h in hits)
    assert store.search('magma "rises') and store.search("") == []


def test_delete_session_removes_its_messages_and_snapshot_row(tmp_path: Path):
    from kvchat.store import SnapshotRow

    store = Store(tmp_path / "kv.db")
    doomed = store.create_session("Doomed")
    kept = store.create_session("Kept")
    store.add_message(doomed.id, "user", "bye")
    store.add_message(kept.id, "user", "stay")
    for session in (doomed, kept):
        store.put_snapshot(
            SnapshotRow(session.id, f"{session.id}.kvs", 3, [1, 2, 3], {"m": 1}, 64, "c")
        )
    store.delete_session(doomed.id)
    assert [s.session.id for s in store.list_sessions()] == [kept.id]
    assert store.search("bye") == []
    assert [m.content for m in store.messages(kept.id)] == ["stay"]
    assert store.get_snapshot(doomed.id) is None
    kept_row = store.get_snapshot(kept.id)
    assert kept_row is not None and kept_row.path == f"{kept.id}.kvs"


# --- the snapshot shelf: KV kept per setting (issue 11 item 3) --------------------------------


def _chunk_row(session_id: str, tokens: list[int], fingerprint: dict, keys: list[str]):
    from kvchat.store import SnapshotRow

    return SnapshotRow(
        session_id,
        "",
        len(tokens),
        tokens,
        fingerprint,
        4 * len(tokens),
        "sum",
        format="chunks",
        chunk_keys=keys,
        layout={},
    )


def _chunk(key: str):
    from kvchat.store import ChunkRow

    return ChunkRow(key, f"{key[:2]}/{key}.kvc", 0, 1, 10, "sum", "", "")


def test_a_snapshot_not_continued_by_the_next_is_shelved_per_fingerprint(tmp_path: Path):
    store = Store(tmp_path / "kvchat.db")
    sid = store.create_session("s").id
    f16, q8 = {"type_k": "f16"}, {"type_k": "q8_0"}
    long = _chunk_row(sid, list(range(100)), f16, ["aa1"])
    store.put_snapshot(long, [_chunk("aa1")])
    store.put_snapshot(_chunk_row(sid, list(range(120)), f16, ["aa1", "aa2"]), [_chunk("aa2")])
    assert store.shelved_snapshots(sid) == []  # a continuation replaces its start

    window = _chunk_row(sid, [0, 50, 51], f16, ["bb1"])  # another n_ctx's window
    store.put_snapshot(window, [_chunk("bb1")])
    assert store.get_snapshot(sid).n_tokens == 3
    assert [r.n_tokens for r in store.shelved_snapshots(sid)] == [120]
    # A shorter row never replaces a longer one of its fingerprint on the shelf.
    store.put_snapshot(_chunk_row(sid, [0, 60], f16, ["cc1"]), [_chunk("cc1")])
    assert [r.n_tokens for r in store.shelved_snapshots(sid)] == [120]
    # A run with other KV types: its snapshot is current, the f16 one stays shelved.
    store.put_snapshot(_chunk_row(sid, [7, 8], q8, ["dd1"]), [_chunk("dd1")])
    assert store.get_snapshot(sid).fingerprint == q8
    assert [r.n_tokens for r in store.shelved_snapshots(sid)] == [120]
    # Shelved chains keep their chunks; the dropped window's chunks are unused.
    assert {c.key for c in store.unreferenced_chunks()} == {"bb1", "cc1"}

    assert store.promote_snapshot(sid, f16)
    assert store.get_snapshot(sid).n_tokens == 120
    # The q8_0 one takes its own place on the shelf.
    shelved = {r.fingerprint["type_k"]: r.n_tokens for r in store.shelved_snapshots(sid)}
    assert shelved == {"q8_0": 2}
    assert not store.promote_snapshot(sid, {"type_k": "q4_0"})

    store.delete_snapshot(sid)
    assert store.get_snapshot(sid) is None and store.shelved_snapshots(sid) == []
    store.close()


# --- reply versions (issue 11 item 10) ---------------------------------------------------------


def test_reply_versions_keep_every_reply_and_the_row_holds_the_current_one(tmp_path: Path):
    store = Store(tmp_path / "kvchat.db")
    sid = store.create_session("s").id
    store.add_message(sid, "user", "Hi")
    first = store.add_message(sid, "assistant", "Hello there", token_count=2)
    assert store.version_of(first.id) == (1, 1)
    assert store.switch_version(first.id, -1) is None

    second = store.add_version(first.id, "Howdy partner", token_count=3)
    third = store.add_version(first.id, "Greetings", token_count=1, partial=True)
    assert second.id == third.id == first.id  # one message, three versions
    assert store.version_of(first.id) == (3, 3)
    assert store.versions_in(sid) == {first.id: (3, 3)}
    assert [m.content for m in store.messages(sid)] == ["Hi", "Greetings"]
    assert store.messages(sid)[-1].partial
    assert store.switch_version(first.id, +1) is None  # the newest is current

    back = store.switch_version(first.id, -1)
    assert back is not None and back.content == "Howdy partner" and back.token_count == 3
    assert store.version_of(first.id) == (2, 3) and not back.partial
    # Search sees the current version only.
    assert [h.message.content for h in store.search("Howdy")] == ["Howdy partner"]
    assert store.search("Greetings") == []
    # Continuing the current version keeps its version in step.
    store.update_message(first.id, "Howdy partner, welcome", False, token_count=5)
    store.switch_version(first.id, -1)
    assert store.get_message(first.id).content == "Hello there"
    again = store.switch_version(first.id, +1)
    assert again is not None and again.content == "Howdy partner, welcome"

    store.delete_session(sid)  # its versions go with its messages
    with sqlite3.connect(tmp_path / "kvchat.db") as db:
        assert db.execute("SELECT COUNT(*) FROM reply_versions").fetchone() == (0,)
    store.close()


def test_a_database_before_m010_gets_parent_ids_null(tmp_path: Path):
    path = tmp_path / "kv.db"
    store = Store(path)
    made = store.create_session("Old")
    store.close()
    db = sqlite3.connect(path)
    with db:
        db.execute("ALTER TABLE sessions DROP COLUMN parent_id")
        db.execute("DELETE FROM _migrations WHERE name='m010_session_parent'")
    db.close()
    again = Store(path)
    assert again.applied_migrations == ["m010_session_parent"]
    assert again.get_session(made.id).parent_id is None
    copy = again.copy_session(made.id, "Old (fork)")
    assert copy.parent_id == made.id
    again.close()
