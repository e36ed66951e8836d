"""A large ChatGPT ``conversations.json`` imports as it is read: the reader holds one
conversation and a read-ahead whatever the file's size, a cut or broken file stores
nothing and says where, and the file-size limit of whole-document JSON does not apply."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.bench.export_gen import RARE_WORD, rare_hits, write_chatgpt_export
from kvchat.config import load_settings
from kvchat.service.chat import ChatService, open_service
from kvchat.transfer import BadFile, import_file
from kvchat.transfer.importer import ImportProgress
from kvchat.transfer.json_stream import ArrayReader


@pytest.fixture
def service(kvhome: Path) -> Iterator[ChatService]:
    with open_service(load_settings(), home=kvhome) as chat:
        yield chat


def _read(data: bytes, chunk: int, max_element: int = 1 << 20) -> tuple[list, ArrayReader]:
    reader = ArrayReader(Path("f.json"), io.BytesIO(data), max_element=max_element, chunk=chunk)
    return list(reader), reader


DOCUMENT = [
    {"a": "x" * 50, "n": 1.5e3, "t": True, "u": 'caf\u00e9 \u2603 \\ " \n'},
    [],
    "plain",
    12345678,
    None,
    {"deep": [[[[{"k": "v"}]]]]},
    -0.25,
]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_every_cut_between_reads_gives_the_same_elements(chunk):
    data = ("\ufeff \n" + json.dumps(DOCUMENT, ensure_ascii=False, indent=1)).encode()
    elements, reader = _read(data, chunk)
    assert elements == DOCUMENT
    assert reader.bytes_read == len(data)


def test_the_reader_holds_one_element_and_a_read_ahead_not_the_file():
    element = {"text": "word " * 2000}  # ~10 kB each
    data = json.dumps([element] * 300).encode()  # ~3 MB
    chunk = 4096
    reader = ArrayReader(Path("f.json"), io.BytesIO(data), max_element=1 << 20, chunk=chunk)
    peak, count = 0, 0
    for got in reader:
        assert got == element
        count += 1
        peak = max(peak, len(reader.buf))
    one = len(json.dumps(element))
    assert count == 300
    assert peak <= 2 * one + 2 * chunk < len(data) // 50


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b'[{"a": 1},\n {"a": 2,, }]', "line 2, column 10"),
        (b'[{"a": 1}\n {"a": 2}]', "Expecting ',' delimiter"),
        (b'[{"a": "unterminated', "Unterminated string"),
        (b'[{"a": 1}', "cut off"),
        (b'[{"a": 1}] trailing', "Extra data"),
        (b'[{"a": NaN}]', "NaN is not a JSON value"),
        (b'[{"a": "\xff"}]', "invalid byte at offset 8"),
        (b"[" * 5000 + b"]" * 5000, "levels deep"),
    ],
)
def test_a_broken_list_says_where_on_one_line(data, where):
    for chunk in (3, 1 << 20):  # the same place, however the reads fell
        with pytest.raises(BadFile) as raised:
            _read(data, chunk=chunk)
        assert where in str(raised.value) and "\n" not in str(raised.value)


def test_one_element_over_the_bound_is_refused_before_it_is_all_read():
    data = b'[{"a": "' + b"x" * 100_000 + b'"}]'
    reader = ArrayReader(Path("f.json"), io.BytesIO(data), max_element=10_000, chunk=1000)
    with pytest.raises(BadFile, match="over 10,000 characters"):
        list(reader)
    assert reader.bytes_read < 50_000


def test_a_large_export_imports_in_one_transaction_with_progress(service, tmp_path, monkeypatch):
    path = tmp_path / "conversations.json"
    size = write_chatgpt_export(path, 40, 26)
    # Over the whole-document limit: a ChatGPT export is read as it goes, so it still imports.
    monkeypatch.setattr("kvchat.transfer.importer.MAX_JSON_BYTES", size // 10)
    seen: list[ImportProgress] = []
    result = import_file(service, path, progress=seen.append)
    assert result.format == "ChatGPT export"
    assert len(result.sessions) == 40 and all(s.messages == 26 for s in result.sessions)
    assert [p.sessions for p in seen] == list(range(1, 41))
    assert [p.messages for p in seen] == [26 * i for i in range(1, 41)]
    assert size - 4 <= seen[-1].bytes_done <= seen[-1].bytes_total == size  # all but ']\n'
    assert seen[0].bytes_done < size // 20
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:]))
    assert service.store.count_sessions() == 40
    # The newest conversation first, by its own update time; the text is all there.
    newest = service.store.list_sessions_page(1).sessions[0]
    assert newest.session.title.startswith("Conversation 0:") and newest.messages == 26
    assert len(service.store.search(RARE_WORD, limit=100)) == rare_hits(40, 26) == 1
    again = import_file(service, path)
    assert again.already and len(again.sessions) == 40
    assert all(s.messages == 26 and not s.new for s in again.sessions)


@pytest.mark.parametrize("cut", [0.3, 0.999])
def test_a_cut_export_stores_nothing(service, tmp_path, cut):
    path = tmp_path / "conversations.json"
    write_chatgpt_export(path, 12, 4)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(BadFile, match="not valid JSON|cut off"):
        import_file(service, path)
    assert service.store.count_sessions() == 0


def test_a_bad_conversation_late_in_the_file_stores_none_of_it(service, tmp_path):
    path = tmp_path / "conversations.json"
    write_chatgpt_export(path, 30, 4)
    document = json.loads(path.read_text())
    document[27]["mapping"]["n1"]["message"]["author"]["role"] = "narrator"
    path.write_text(json.dumps(document))
    with pytest.raises(BadFile, match="conversation 28.*unknown role 'narrator'"):
        import_file(service, path)
    assert service.store.count_sessions() == 0


def test_limits_hold_while_streaming(service, tmp_path, monkeypatch):
    path = tmp_path / "conversations.json"
    write_chatgpt_export(path, 5, 4)
    monkeypatch.setattr("kvchat.transfer.common.MAX_MESSAGES", 12)
    with pytest.raises(BadFile, match="more than 12 messages is over the limit"):
        import_file(service, path)
    assert service.store.count_sessions() == 0


def test_other_json_still_reads_whole_and_keeps_its_limit(service, tmp_path, monkeypatch):
    path = tmp_path / "openai.json"
    path.write_text(json.dumps([{"role": "user", "content": "hello"}]))
    assert import_file(service, path).format != "ChatGPT export"
    monkeypatch.setattr("kvchat.transfer.importer.MAX_JSON_BYTES", 10)
    other = tmp_path / "openai2.json"
    other.write_text(json.dumps([{"role": "user", "content": "hello again"}]))
    with pytest.raises(BadFile, match="JSON limit"):
        import_file(service, other)


def _fts_trigger(service: ChatService) -> str | None:
    row = service.store.conn.execute(
        "SELECT sql FROM sqlite_master WHERE type='trigger' AND name='messages_ai'"
    ).fetchone()
    return row[0] if row else None


def test_an_import_indexes_its_messages_for_search_and_puts_the_trigger_back(service, tmp_path):
    before = _fts_trigger(service)
    assert before is not None
    session = service.sessions.new_session("Made here")
    service.sessions.add_message(session.id, "user", "a zebra before the import")
    path = tmp_path / "conversations.json"
    write_chatgpt_export(path, 40, 26)
    import_file(service, path)
    assert _fts_trigger(service) == before  # as it was
    # Every imported message is in the index once, and nothing else moved in it.
    hits = service.store.search(RARE_WORD, limit=100)
    assert len(hits) == rare_hits(40, 26) + 1
    db = service.store.conn
    indexed = db.execute(
        "SELECT COUNT(*) FROM messages_fts WHERE messages_fts MATCH 'river'"
    ).fetchone()[0]
    stored = db.execute("SELECT COUNT(*) FROM messages WHERE content LIKE '%river%'").fetchone()
    assert indexed == stored[0] > 1000
    # FTS5's own check of the index against the messages (raises when they differ).
    with db:
        db.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)")
    service.sessions.add_message(
        session.id, "user", "a zebra after the import"
    )  # the trigger works
    assert len(service.store.search(RARE_WORD, limit=100)) == rare_hits(40, 26) + 2


def test_a_failed_import_leaves_the_search_trigger_in_place(service, tmp_path):
    before = _fts_trigger(service)
    path = tmp_path / "conversations.json"
    write_chatgpt_export(path, 30, 4)
    document = json.loads(path.read_text())
    document[20]["mapping"]["n1"]["message"]["author"]["role"] = "narrator"
    path.write_text(json.dumps(document))
    with pytest.raises(BadFile):
        import_file(service, path)
    assert _fts_trigger(service) == before
    session = service.sessions.new_session("After")
    service.sessions.add_message(session.id, "user", "zebra")
    assert len(service.store.search(RARE_WORD)) == 1
