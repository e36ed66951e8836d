"""The store keeps each attached document's text once and which sessions use it, where."""

from __future__ import annotations

from pathlib import Path

from kvchat.store import Store
from kvchat.store.documents_sql import DocumentRow


def doc(name: str, text: str, *, library: bool = False) -> DocumentRow:
    sha = f"{abs(hash(text)):064x}"[:64]
    return DocumentRow(
        id=DocumentRow.key(name, sha),
        name=name,
        kind="text",
        size=len(text.encode()),
        sha256=sha,
        text=text,
        source=f"/somewhere/{name}",
        in_library=library,
    )


def test_a_session_lists_its_start_documents_in_order_then_those_of_its_messages(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "kv.db")
    a, b, c = doc("a.md", "alpha"), doc("b.md", "beta"), doc("c.md", "gamma")
    store.put_documents([a, b, c])
    session = store.create_session()
    store.attach_documents(session.id, [b.id, a.id])
    question = store.add_message(session.id, "user", "what now?")
    store.attach_documents(session.id, [c.id], message_id=question.id)
    store.attach_documents(session.id, [b.id, a.id])  # again: nothing changes

    used = store.session_documents(session.id)
    assert [(u.document.name, u.message_id) for u in used] == [
        ("b.md", None),
        ("a.md", None),
        ("c.md", question.id),
    ]
    assert used[0].document.text == "beta" and used[0].document.sha256 == b.sha256


def test_a_fork_keeps_the_documents_of_its_start_and_of_the_messages_it_copies(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "kv.db")
    a, c = doc("a.md", "alpha"), doc("c.md", "gamma")
    store.put_documents([a, c])
    session = store.create_session()
    store.attach_documents(session.id, [a.id])
    first = store.add_message(session.id, "user", "one")
    store.add_message(session.id, "assistant", "reply")
    later = store.add_message(session.id, "user", "two")
    store.attach_documents(session.id, [c.id], message_id=later.id)

    early = store.copy_session(session.id, "fork", upto_message=first.id)
    whole = store.copy_session(session.id, "fork all")

    assert [u.document.name for u in store.session_documents(early.id)] == ["a.md"]
    copied = store.session_documents(whole.id)
    assert [u.document.name for u in copied] == ["a.md", "c.md"]
    fork_messages = store.messages(whole.id)
    assert copied[1].message_id == fork_messages[2].id != later.id


def test_documents_no_session_uses_are_forgotten_unless_the_library_keeps_them(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "kv.db")
    kept, used, loose = doc("kept.md", "k", library=True), doc("u.md", "u"), doc("l.md", "l")
    store.put_documents([kept, used, loose])
    session = store.create_session()
    store.attach_documents(session.id, [used.id])
    assert store.document_use() == {used.id: 1}

    assert store.forget_unused_documents() == 1
    assert {d.name for d in store.documents()} == {"kept.md", "u.md"}
    assert [d.name for d in store.documents(library=True)] == ["kept.md"]

    store.delete_session(session.id)
    assert store.forget_unused_documents() == 1
    assert store.set_in_library(kept.id, False)
    assert store.forget_unused_documents() == 1
    assert store.documents() == []
    assert not store.set_in_library("no-such-document", True)


def test_storing_a_document_again_keeps_its_text_and_never_unkeeps_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "kv.db")
    first = doc("a.md", "alpha", library=True)
    store.put_documents([first])
    store.put_documents([DocumentRow(**{**first.__dict__, "in_library": False})])
    (row,) = store.documents()
    assert row.in_library and row.text == "alpha"
