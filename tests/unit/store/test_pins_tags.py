"""Pinned sessions and tags (issue 41, item 7) on a real SQLite file: kept on the session
row, moving the change stamp (so every open list sees them) but not ``updated``, filtered
by the list's pages and counts, and tags parsed once from what a user types."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store
from kvchat.store.tags import MAX_TAGS, parse_tags, tags_text


@pytest.fixture
def store(tmp_path: Path):
    opened = Store(tmp_path / "kvchat.db")
    yield opened
    opened.close()


def test_pin_and_tags_are_kept_and_move_the_stamp_not_the_update_time(store):
    made = store.create_session("Rust notes")
    stamp = store.change_stamp()
    pinned = store.set_pinned(made.id, True)
    assert pinned.pinned and pinned.updated == made.updated
    assert store.change_stamp() > stamp
    changes = store.sessions_changed_since(stamp)
    assert [s.session.id for s in changes.changed] == [made.id]
    stamp = store.change_stamp()
    tagged = store.set_tags(made.id, ("work", "rust"))
    assert tagged.tags == ("work", "rust") and tagged.updated == made.updated
    assert store.change_stamp() > stamp
    summary = store.list_sessions_page(5).sessions[0]
    assert summary.to_json()["pinned"] is True
    assert summary.to_json()["tags"] == ["work", "rust"]
    assert store.set_pinned(made.id, False).pinned is False


def test_pages_and_counts_keep_pinned_and_tagged_sessions_only(store):
    ids = [store.create_session(f"Topic {i}").id for i in range(12)]
    for session_id in ids[::3]:
        store.set_pinned(session_id, True)
    store.set_tags(ids[1], ("work",))
    store.set_tags(ids[2], ("workshop", "home"))
    store.set_tags(ids[4], ("home", "work"))
    pinned = {s.session.id for s in store.list_sessions_page(50, pinned=True).sessions}
    assert pinned == set(ids[::3]) and store.count_sessions(pinned=True) == 4
    work = {s.session.id for s in store.list_sessions_page(50, tag="work").sessions}
    assert work == {ids[1], ids[4]}  # a whole tag: "workshop" is not "work"
    assert store.count_sessions(tag="home") == 2
    both = store.list_sessions_page(50, tag="work", pinned=True).sessions
    assert [s.session.id for s in both] == [] and store.count_sessions(tag="nothing") == 0
    # A LIKE wildcard in a tag matches itself only.
    assert store.count_sessions(tag="w_rk") == 0


def test_tags_are_parsed_once_and_anything_else_is_one_clear_line():
    assert parse_tags("Work #rust, ideas  rust") == ("work", "rust", "ideas")
    assert parse_tags("  ") == () and parse_tags("#") == ()
    assert tags_text(("work", "rust")) == "#work #rust"
    for hostile in ("a/b", "x" * 40, "\x1b[31m", "a%b", "'; DROP", "tab\ttab\x00"):
        with pytest.raises(KvchatError) as caught:
            parse_tags(hostile)
        message = str(caught.value)
        assert "\n" not in message and "\x1b" not in message and "\x00" not in message
    with pytest.raises(KvchatError, match="at most"):
        parse_tags(" ".join(f"t{i}" for i in range(MAX_TAGS + 1)))


def test_a_tags_column_not_written_by_kvchat_reads_as_no_tags(store):
    made = store.create_session("Odd")
    store.conn.execute("UPDATE sessions SET tags=? WHERE id=?", ("ok \x1b[2J", made.id))
    store.conn.commit()
    assert store.get_session(made.id).tags == ()


def test_a_branch_keeps_the_tags_and_the_replies_figures_not_the_pin(store):
    from kvchat.store.figures_sql import MessageFigures

    source = store.create_session("Source")
    store.add_message(source.id, "user", "Hi", token_count=2)
    reply = store.add_message(source.id, "assistant", "Hello", token_count=3)
    store.record_figures(reply.id, MessageFigures(model="m", generated=3, tokens_per_s=9.0))
    store.set_tags(source.id, ("work",))
    store.set_pinned(source.id, True)
    branch = store.copy_session(source.id, "Branch")
    assert branch.tags == ("work",) and not branch.pinned
    copied = store.messages(branch.id)[-1]
    kept = store.message_figures(copied.id)
    assert kept is not None and (kept.model, kept.generated, kept.tokens_per_s) == ("m", 3, 9.0)
