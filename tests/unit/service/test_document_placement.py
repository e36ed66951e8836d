"""Where documents go in a prompt: one canonical block after the system prompt for those a
conversation starts with (so conversations about the same documents share a token
prefix, up to where the template starts the question), and before the text of the
message a later document came with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvchat.errors import DocumentError, KvchatError
from kvchat.service.documents import DocumentShelf, is_reading, reading_id, system_message
from kvchat.store import Store


class CharEngine:
    """A stand-in for a token engine's template: one token per character of a ChatML-like
    rendering (or, with ``folds``, Gemma's: the system text inside the first user turn)."""

    def __init__(self, *, folds: bool = False, n_ctx: int = 4096, batch_align: int = 1) -> None:
        self.folds = folds
        self.n_ctx = n_ctx
        self.batch_align = batch_align

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text, system = "", ""
        for m in messages:
            if m["role"] == "system" and self.folds:
                system = m["content"] + "\n\n"
            elif m["role"] == "user" and self.folds:
                text += f"<u>{system}{m['content']}</u>"
                system = ""
            else:
                text += f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>"
        return [ord(c) for c in text + "<a>"]


def shelf_with(tmp_path: Path, files: dict[str, str]) -> tuple[DocumentShelf, list[str]]:
    paths = []
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        paths.append(str(path))
    return DocumentShelf(Store(tmp_path / "kv.db")), paths


def test_documents_read_in_any_order_give_the_same_rows_in_the_same_order(tmp_path: Path) -> None:
    shelf, paths = shelf_with(tmp_path, {"b.md": "# Beta\n", "a.txt": "alpha\n"})
    forward = shelf.read(paths)
    backward = shelf.read(list(reversed(paths)) + paths[:1])  # and one named twice
    assert [r.name for r in forward.rows] == ["a.txt", "b.md"]
    assert forward.rows == backward.rows


def test_a_path_kvchat_will_not_read_is_one_line_and_nothing_is_returned(tmp_path: Path) -> None:
    shelf, paths = shelf_with(tmp_path, {"a.txt": "alpha\n"})
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DocumentError) as refused:
        shelf.read([*paths, str(tmp_path / "blob.bin")])
    assert "\n" not in str(refused.value) and "blob.bin" in str(refused.value)


def test_start_documents_follow_the_system_prompt_and_later_ones_precede_their_message(
    tmp_path: Path,
) -> None:
    shelf, paths = shelf_with(tmp_path, {"a.txt": "alpha\n", "later.txt": "gamma\n"})
    store = shelf.store
    session = store.create_session(system_prompt="Be brief.")
    shelf.give(session.id, shelf.read(paths[:1]))
    question = store.add_message(session.id, "user", "What is in it?")
    store.add_message(session.id, "assistant", "Alpha.")
    follow_up = store.add_message(session.id, "user", "And this one?")
    shelf.give(session.id, shelf.read(paths[1:]), follow_up.id)

    head = shelf.head(store.get_session(session.id), "Be brief.")
    assert head == [
        {
            "role": "system",
            "content": 'Be brief.\n\n<document name="a.txt" kind="text">\nalpha\n</document>',
        }
    ]
    chat = shelf.chat(session.id, store.messages(session.id))
    assert chat[0] == {"role": "user", "content": question.content}
    assert chat[2]["content"] == (
        '<document name="later.txt" kind="text">\ngamma\n</document>\n\nAnd this one?'
    )
    assert store.messages(session.id)[2].content == "And this one?"  # the text stays the user's


def test_without_a_system_prompt_the_documents_alone_are_the_system_message() -> None:
    assert system_message(None, "") == []
    assert system_message("Be brief.", "") == [{"role": "system", "content": "Be brief."}]
    assert system_message(None, "DOCS") == [{"role": "system", "content": "DOCS"}]


@pytest.mark.parametrize("folds", [False, True], ids=["system-role", "gemma-folds-system"])
def test_the_shared_prefix_ends_where_the_template_starts_the_question(
    tmp_path: Path, folds: bool
) -> None:
    shelf, _ = shelf_with(tmp_path, {})
    engine: Any = CharEngine(folds=folds)
    head = system_message("Be brief.", "DOCS")
    end = shelf.shared_end(engine, head)
    for question in ("What?", "Why not?", "a", "b"):
        prompt = engine.chat_tokens([*head, {"role": "user", "content": question}])
        assert prompt[:end] == engine.chat_tokens([*head, {"role": "user", "content": "x"}])[:end]
        rest = "".join(map(chr, prompt[end:]))
        assert rest.startswith(question)  # nothing of the question lies inside the prefix
    what = engine.chat_tokens([*head, {"role": "user", "content": "What?"}])
    assert "".join(map(chr, what[:end])).endswith("DOCS</s><u>" if not folds else "DOCS\n\n")


@pytest.mark.parametrize("align", [4, 16])
def test_the_shared_prefix_ends_where_a_prefill_can_start(tmp_path: Path, align: int) -> None:
    """Repacked weights decode in tiles: a reading that ended inside one would be restored
    only up to the tile before it (a recurrent state, which can't be cut, not at all)."""
    shelf, _ = shelf_with(tmp_path, {})
    head = system_message("Be brief.", "DOCS" * 7)
    plain, tiles = CharEngine(), CharEngine(batch_align=align)
    exact = shelf.shared_end(plain, head)  # type: ignore[arg-type]
    tiled = shelf.shared_end(tiles, head)  # type: ignore[arg-type]
    assert exact % align and tiled == exact - exact % align


def test_documents_that_leave_no_room_for_the_conversation_are_one_line(tmp_path: Path) -> None:
    shelf, _ = shelf_with(tmp_path, {})
    head = system_message(None, "D" * 900)
    fits = shelf.fit(CharEngine(n_ctx=2048), head, reserve=256, speed=100.0)  # type: ignore[arg-type]
    assert fits.tokens > 900 and fits.seconds == pytest.approx(fits.tokens / 100.0)
    assert "of the context (2,048)" in fits.line()
    with pytest.raises(KvchatError) as refused:
        shelf.fit(CharEngine(n_ctx=1024), head, reserve=256, speed=None)  # type: ignore[arg-type]
    assert "no room for the conversation" in str(refused.value)


def test_a_reading_is_named_by_its_tokens_and_the_model_that_read_them() -> None:
    one = reading_id([1, 2, 3], "model-a")
    assert is_reading(one) and one == reading_id([1, 2, 3], "model-a")
    assert one != reading_id([1, 2, 4], "model-a") != reading_id([1, 2, 3], "model-b")
