"""The session list at scale, on a real SQLite file: pages on the ``updated``
index, a title filter on its trigram index, a count, what changed since a stamp (another
process's writes included), and message search that ranks only the newest matches."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store, messages_sql


@pytest.fixture
def store(tmp_path: Path):
    opened = Store(tmp_path / "kvchat.db")
    yield opened
    opened.close()


def _sessions(store: Store, n: int, *, start: int = 0) -> list[str]:
    """``n`` sessions titled "Topic <i>", updated a minute apart (the last one newest)."""
    ids = []
    for i in range(start, start + n):
        session = store.create_session(f"Topic {i}")
        stamp = f"2026-01-01T{i // 60:02d}:{i % 60:02d}:00.000+00:00"
        store.conn.execute("UPDATE sessions SET updated=? WHERE id=?", (stamp, session.id))
        store.conn.commit()
        ids.append(session.id)
    return ids


def _pages(store: Store, size: int, title: str | None = None) -> list[list[str]]:
    pages, after = [], None
    while True:
        page = store.list_sessions_page(size, after, title=title)
        pages.append([s.session.id for s in page.sessions])
        if page.next is None:
            return pages
        after = page.next


def test_pages_walk_every_session_once_newest_first(store):
    ids = _sessions(store, 23)
    pages = _pages(store, 5)
    assert [len(p) for p in pages] == [5, 5, 5, 5, 3]
    walked = [i for page in pages for i in page]
    assert walked == list(reversed(ids))
    assert walked == [s.session.id for s in store.list_sessions()]  # the whole list's order
    assert store.count_sessions() == 23
    assert store.list_sessions_page(50).next is None
    assert store.list_sessions_page(0).sessions == []


def test_sessions_with_the_same_update_time_are_neither_lost_nor_repeated(store):
    ids = [store.create_session(f"Same {i}").id for i in range(7)]
    store.conn.execute("UPDATE sessions SET updated='2026-01-01T00:00:00.000+00:00'")
    store.conn.commit()
    walked = [i for page in _pages(store, 2) for i in page]
    assert sorted(walked) == sorted(ids) and len(walked) == 7
    assert walked == list(reversed(ids))  # the newest made first, as the whole list has it


def test_a_page_reads_a_range_of_the_updated_index_not_the_table(store):
    _sessions(store, 3)
    sql = (
        "EXPLAIN QUERY PLAN SELECT s.* FROM sessions s INDEXED BY sessions_by_updated"
        " WHERE (s.updated, s.rowid) < (?, ?) ORDER BY s.updated DESC, s.rowid DESC LIMIT 5"
    )
    plan = " / ".join(row[3] for row in store.conn.execute(sql, ("x", 1)).fetchall())
    assert "USING INDEX sessions_by_updated" in plan and "TEMP B-TREE" not in plan
    changed = store.conn.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM sessions WHERE changed > ? ORDER BY changed", (0,)
    ).fetchall()
    assert "USING INDEX sessions_by_changed" in changed[0][3]


def test_the_title_filter_pages_through_matches_only(store):
    _sessions(store, 30)
    store.update_session(store.list_sessions_page(1).sessions[0].session.id, title="Kyoto trip")
    # "opic 1" is in Topic 1, 10-19 (the trigram index); "c 2" in Topic 2, 20-28 (29 is
    # Kyoto now).
    pages = _pages(store, 4, title="OPIC 1")
    titles = [store.get_session(i).title for page in pages for i in page]
    assert sorted(titles) == sorted(["Topic 1", *(f"Topic {i}" for i in range(10, 20))])
    assert store.count_sessions(title="opic 1") == 11
    assert store.count_sessions(title="c 2") == 10
    # Shorter than a trigram: read in list order, as far as the page goes.
    assert [s.session.title for s in store.list_sessions_page(2, title="yo").sessions] == [
        "Kyoto trip"
    ]
    assert store.count_sessions(title="%") == 0  # LIKE's wildcards are letters here
    assert store.count_sessions(title='"kyoto') == 0
    store.update_session(store.list_sessions_page(2).sessions[1].session.id, title='Say "hi"')
    assert store.count_sessions(title='y "hi') == 1  # quotes are letters too
    assert store.count_sessions(title="  ") == 30
    # A rename moves the title's index entries along.
    assert store.count_sessions(title="kyoto") == 1
    assert store.count_sessions(title="topic 29") == 0


def test_changes_since_a_stamp_name_what_was_made_changed_and_deleted(store, tmp_path):
    a, b, c = _sessions(store, 3)
    stamp = store.change_stamp()
    assert store.sessions_changed_since(stamp).changed == []
    store.update_session(a, title="Renamed")
    store.add_message(b, "user", "hello")  # moves b's updated time
    store.delete_session(c)
    # Another process (a `kvchat import`): its rows carry old update times.
    other = Store(tmp_path / "kvchat.db")
    [(imported, new)] = other.import_sessions(
        [
            {
                "title": "From ChatGPT",
                "created": "2020-01-01T00:00:00.000+00:00",
                "updated": "2020-01-01T00:00:00.000+00:00",
                "messages": [("user", "old", None, 0, False)],
            }
        ],
        "import:file",
    )
    other.close()
    assert new
    changes = store.sessions_changed_since(stamp)
    assert [s.session.id for s in changes.changed] == [a, b, imported]
    assert changes.changed[1].messages == 1
    assert changes.deleted == [c]
    assert changes.stamp == store.change_stamp() > stamp
    nothing = store.sessions_changed_since(changes.stamp)
    assert (nothing.changed, nothing.deleted, nothing.stamp) == ([], [], changes.stamp)


def test_a_session_deleted_then_changed_back_is_not_reported_deleted(store):
    [a] = _sessions(store, 1)
    stamp = store.change_stamp()
    row = store.conn.execute("SELECT * FROM sessions WHERE id=?", (a,)).fetchone()
    store.delete_session(a)
    store.conn.execute(
        "INSERT INTO sessions (id, title, settings, created, updated) VALUES (?, ?, '{}', ?, ?)",
        (a, "Back", row[4], row[5]),
    )
    store.conn.commit()
    changes = store.sessions_changed_since(stamp)
    assert [s.session.title for s in changes.changed] == ["Back"] and changes.deleted == []


def test_an_older_database_gets_the_indexes_and_stamps(tmp_path):
    path = tmp_path / "kvchat.db"
    store = Store(path)
    ids = _sessions(store, 4)
    store.close()
    conn = sqlite3.connect(path)  # as before migration 14
    for name in (
        "sessions_stamp_insert",
        "sessions_stamp_update",
        "sessions_stamp_delete",
        "sessions_title_fts_insert",
        "sessions_title_fts_delete",
        "sessions_title_fts_update",
    ):
        conn.execute(f"DROP TRIGGER {name}")
    for name in ("sessions_by_updated", "sessions_by_changed"):
        conn.execute(f"DROP INDEX {name}")
    conn.execute("DROP TABLE sessions_title_fts")
    conn.execute("DELETE FROM _migrations WHERE name='m014_session_list_at_scale'")
    conn.commit()
    conn.close()
    store = Store(path)
    try:
        assert store.applied_migrations == ["m014_session_list_at_scale"]
        assert [s.session.id for s in store.list_sessions_page(10).sessions] == ids[::-1]
        assert store.count_sessions(title="topic 2") == 1
        assert store.change_stamp() >= 4
        stamp = store.change_stamp()
        store.update_session(ids[0], title="New")
        assert [s.session.id for s in store.sessions_changed_since(stamp).changed] == [ids[0]]
    finally:
        store.close()


def test_search_ranks_only_the_newest_matches_of_a_common_word(store, monkeypatch):
    monkeypatch.setattr(messages_sql, "RANKED_MATCHES", 5)
    session = store.create_session("S")
    for i in range(12):
        # Older messages repeat the word: bm25 would rank them first.
        text = "river " * (12 - i) + f"number{i}"
        store.add_message(session.id, "user", text)
    hits = store.search("river", limit=50)
    assert sorted(h.message.content.split()[-1] for h in hits) == sorted(
        f"number{i}" for i in range(7, 12)
    )
    assert [h.message.content.split()[-1] for h in store.search("number3")] == ["number3"]
    monkeypatch.setattr(messages_sql, "RANKED_MATCHES", 5000)
    best = store.search("river", limit=3)
    assert [h.message.content.split()[-1] for h in best] == ["number0", "number1", "number2"]


def test_a_long_session_reads_back_a_page_at_a_time(store):
    session = store.create_session("Long")
    ids = [store.add_message(session.id, "user", f"m{i}").id for i in range(23)]
    other = store.create_session("Other")
    store.add_message(other.id, "user", "elsewhere")
    pages, before = [], None
    while True:
        page = store.messages_page(session.id, 10, before=before)
        if not page:
            break
        pages.insert(0, [m.content for m in page])
        before = page[0].id
    assert [len(p) for p in pages] == [3, 10, 10]
    assert [c for p in pages for c in p] == [f"m{i}" for i in range(23)]
    assert [m.id for m in store.messages_page(session.id, 2, before=ids[5])] == ids[3:5]
    assert store.messages_page(session.id, 0) == []
    assert (store.message_count(session.id), store.message_count("nosuchid")) == (23, 0)
    plan = store.conn.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM messages WHERE session_id=? AND id<?"
        " ORDER BY id DESC LIMIT 10",
        ("x", 5),
    ).fetchall()
    assert "USING INDEX" in plan[0][3] and "TEMP B-TREE" not in " ".join(r[3] for r in plan)


def test_a_window_of_a_long_session_says_where_it_sits(store):
    session = store.create_session("Long")
    ids = [store.add_message(session.id, "user", f"m{i}").id for i in range(23)]
    other = store.create_session("Other")
    elsewhere = store.add_message(other.id, "user", "elsewhere").id
    last = store.message_window(session.id, 10)
    assert [m.id for m in last.messages] == ids[13:] and (last.first, last.total) == (13, 23)
    assert last.later == 0 and last.updated == store.get_session(session.id).updated
    start = store.message_window(session.id, 10, from_start=True)
    assert [m.id for m in start.messages] == ids[:10] and (start.first, start.later) == (0, 13)
    hit = store.message_window(session.id, 5, around=ids[7], before_hit=2)
    assert [m.id for m in hit.messages] == ids[5:10] and (hit.first, hit.later) == (5, 13)
    near_start = store.message_window(session.id, 5, around=ids[0], before_hit=2)
    assert [m.id for m in near_start.messages] == ids[:5] and near_start.first == 0
    near_end = store.message_window(session.id, 5, around=ids[22], before_hit=2)
    assert [m.id for m in near_end.messages] == ids[20:] and near_end.first == 20
    # A message of another session is no place in this one: the last ones.
    assert store.message_window(session.id, 3, around=elsewhere).first == 20
    with pytest.raises(KvchatError, match="no session"):
        store.message_window("nosuchid", 3)
