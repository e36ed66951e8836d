"""`kvchat import` and portable bundles, model-free: round trips for every format, a
text-only bundle, and files that try to do harm (kvchat.transfer)."""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import load_settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService, open_service
from kvchat.transfer import BadFile, common, import_file, write_bundle
from tests.helpers import llm_logs_db


@pytest.fixture
def service(kvhome: Path) -> Iterator[ChatService]:
    """A service over a fresh home; text formats never load the model."""
    with open_service(load_settings(), home=kvhome) as chat:
        yield chat


def texts(chat: ChatService, session_id: str) -> list[tuple[str, str, bool]]:
    return [(m.role, m.content, m.partial) for m in chat.sessions.messages(session_id)]


def write_json(path: Path, document: Any) -> Path:
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
    return path


# --- round trips ----------------------------------------------------------------------------


def test_kvchat_json_round_trip_keeps_messages_prompt_settings_and_times(service, tmp_path):
    original = service.sessions.new_session("Ünïcode & <b>tags</b>", "Answer in French.")
    kept = {"temperature": 0.2, "seed": 7, "tools_off": ["calc.echo"], "tools_always": ["c.add"]}
    service.sessions.configure(original.id, settings=kept)
    service.sessions.add_message(original.id, "user", "## not a heading\n```\nopen fence")
    service.sessions.add_message(original.id, "assistant", "Réponse 🚀", partial=True)
    service.sessions.add_message(original.id, "user", "   spaces kept   ")
    path = tmp_path / "chat.json"
    path.write_text(service.sessions.export(original.id, "json"), encoding="utf-8")

    result = import_file(service, path)

    assert result.format == "kvchat JSON"
    [item] = result.sessions
    assert item.new and item.session != original.id and item.messages == 3
    copy = service.store.get_session(item.session)
    assert (copy.title, copy.system_prompt, copy.settings) == (
        original.title,
        "Answer in French.",
        kept,
    )
    assert texts(service, copy.id) == texts(service, original.id)
    assert [m.created for m in service.sessions.messages(copy.id)] == [
        m.created for m in service.sessions.messages(original.id)
    ]


def test_openai_messages_both_shapes_with_text_parts(service, tmp_path):
    expected = [("user", "What is KV?", False), ("assistant", "Keys and values.", False)]
    as_object = write_json(
        tmp_path / "object.json",
        {
            "model": "gpt-4o",
            "messages": [
                {"role": "developer", "content": "Be precise."},
                {"role": "user", "content": [{"type": "text", "text": "What is KV?"}]},
                {"role": "assistant", "content": "Keys and values."},
            ],
        },
    )
    as_list = write_json(
        tmp_path / "list.json",
        [
            {"role": "system", "content": [{"type": "text", "text": "Be precise."}]},
            {"role": "user", "content": "What is KV?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Keys and values."},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            },
        ],
    )
    for path, skipped in ((as_object, 0), (as_list, 3)):
        [item] = import_file(service, path).sessions
        session = service.store.get_session(item.session)
        assert session.system_prompt == "Be precise."
        assert session.title == "What is KV?"
        assert texts(service, item.session) == expected
        assert item.skipped == skipped


def chatgpt_conversation(conv_id: str, title: str, branch: str) -> dict[str, Any]:
    """A conversation as ChatGPT exports it: a hidden empty system root, a user message, two
    replies (the first regenerated: ``branch`` picks the current one), a tool call and its
    output, and a last answer on the current branch only."""

    def node(node_id, parent, children, role, parts, **extra):
        message = None
        if role is not None:
            message = {
                "id": node_id,
                "author": {"role": role},
                "create_time": 1_700_000_000.5,
                "content": {"content_type": extra.pop("content_type", "text"), "parts": parts},
                "metadata": extra.pop("metadata", {}),
                "recipient": extra.pop("recipient", "all"),
                **extra,
            }
        return {"id": node_id, "message": message, "parent": parent, "children": children}

    mapping = {
        "root": node("root", None, ["sys"], None, None),
        "sys": node(
            "sys",
            "root",
            ["u1"],
            "system",
            [""],
            metadata={"is_visually_hidden_from_conversation": True},
        ),
        "u1": node("u1", "sys", ["a-old", "a-new"], "user", ["Plan a trip to Kyoto"]),
        "a-old": node("a-old", "u1", [], "assistant", ["An older answer"]),
        "a-new": node("a-new", "u1", ["call"], "assistant", ["Day 1: temples."]),
        "call": node(
            "call", "a-new", ["out"], "assistant", ["search('kyoto')"], recipient="browser"
        ),
        "out": node("out", "call", ["u2"], "tool", ["results…"]),
        # A picture beside the question (ChatGPT puts an asset pointer among the parts).
        "u2": node(
            "u2",
            "out",
            ["a2"],
            "user",
            ["", {"content_type": "image_asset_pointer", "asset_pointer": "file-1"}, "And day 2?"],
            content_type="multimodal_text",
        ),
        "a2": node("a2", "u2", [], "assistant", ["Day 2: ", "markets."]),
    }
    return {
        "title": title,
        "create_time": 1_700_000_000.0,
        "update_time": 1_700_000_100.0,
        "mapping": mapping,
        "current_node": branch,
        "conversation_id": conv_id,
        "id": conv_id,
    }


def test_chatgpt_export_follows_each_conversations_current_branch(service, tmp_path):
    path = write_json(
        tmp_path / "conversations.json",
        [
            chatgpt_conversation("c-1", "Kyoto", "a2"),
            chatgpt_conversation("c-2", "Kyoto, first try", "a-old"),
        ],
    )
    result = import_file(service, path)

    assert result.format == "ChatGPT export"
    first, second = result.sessions
    assert texts(service, first.session) == [
        ("user", "Plan a trip to Kyoto", False),
        ("assistant", "Day 1: temples.", False),
        ("assistant", "search('kyoto')", False),  # a call to the browser tool (issue 43)
        ("tool", "results…", False),
        ("user", "And day 2?", False),
        ("assistant", "Day 2: \nmarkets.", False),
    ]
    assert first.skipped == 1  # the picture (issue 22.17)
    stored = service.sessions.messages(first.session)
    [call] = service.store.tool_calls([stored[2].id])[stored[2].id]
    assert (call.call_id, call.name, call.arguments) == (
        "chatgpt-call",
        "browser",
        '{"input": "search(\'kyoto\')"}',
    )
    record = service.store.tool_records([stored[3].id])[stored[3].id]
    assert (record.name, record.call_id, record.full_text) == (
        "browser",
        "chatgpt-call",
        "results…",
    )
    assert texts(service, second.session) == [
        ("user", "Plan a trip to Kyoto", False),
        ("assistant", "An older answer", False),
    ]
    session = service.store.get_session(first.session)
    assert session.title == "Kyoto" and session.system_prompt is None
    assert session.created.startswith("2023-11-14T22:13:20.000")


def test_a_reexported_archive_imports_only_the_new_conversations(service, tmp_path):
    first = write_json(tmp_path / "a.json", [chatgpt_conversation("c-1", "One", "a2")])
    later = write_json(
        tmp_path / "b.json",
        [chatgpt_conversation("c-1", "One", "a2"), chatgpt_conversation("c-2", "Two", "a2")],
    )
    [one] = import_file(service, first).sessions
    again = import_file(service, later).sessions
    assert [(s.session == one.session, s.new) for s in again] == [(True, False), (False, True)]
    assert len(service.sessions.list_sessions()) == 2


def test_a_real_llm_logs_db_imports_read_only(service, tmp_path):
    path = llm_logs_db(tmp_path / "logs.db")
    before = path.read_bytes()

    result = import_file(service, path)

    assert path.read_bytes() == before
    assert result.format == "llm logs.db"
    by_title = {service.store.get_session(s.session).title: s.session for s in result.sessions}
    assert set(by_title) == {"Hello there", "Lone prompt", "Old chat"}
    assert texts(service, by_title["Hello there"]) == [
        ("user", "Hello there", False),
        ("assistant", "echo: Hello there", False),
        ("user", "Second question", False),
        ("assistant", "echo: Second question", False),
    ]
    assert service.store.get_session(by_title["Hello there"]).system_prompt == "Be terse."
    assert texts(service, by_title["Old chat"]) == [
        ("user", "2+2?", False),
        ("assistant", "4", False),
        ("user", "3+3?", False),
        ("assistant", "6", False),
    ]
    old = service.store.get_session(by_title["Old chat"])
    assert old.system_prompt == "You are a calculator."
    assert old.updated.startswith("2024-05-01T10:01")


def test_importing_the_same_file_twice_says_so(kvhome, tmp_path):
    path = write_json(tmp_path / "chat.json", {"messages": [{"role": "user", "content": "Hi"}]})
    runner = CliRunner()
    first = runner.invoke(main, ["import", str(path), "--json"], catch_exceptions=False)
    second = runner.invoke(main, ["import", str(path)], catch_exceptions=False)
    again = runner.invoke(main, ["import", str(path), "--json"], catch_exceptions=False)

    assert first.exit_code == second.exit_code == again.exit_code == 0
    [made] = json.loads(first.stdout)["sessions"]
    assert made["messages"] == 1 and made["kv"] == {
        "tokens": 0,
        "reason": "OpenAI JSON carries no KV",
        "origin": None,
        "check": None,
    }
    assert (
        second.stdout.strip()
        == f"{path}: already imported (as {made['session']}); nothing imported again"
    )
    [seen] = json.loads(again.stdout)["sessions"]
    assert seen["session"] == made["session"] and seen["already_imported"] is True
    listed = runner.invoke(main, ["list", "--json"], catch_exceptions=False)
    assert len(json.loads(listed.stdout)) == 1


def test_cli_imports_the_good_files_and_reports_each_bad_one_on_one_line(kvhome, tmp_path):
    good = write_json(tmp_path / "good.json", [{"role": "user", "content": "Hi"}])
    bad = tmp_path / "bad.json"
    bad.write_text("{oops", encoding="utf-8")
    result = CliRunner().invoke(main, ["import", str(bad), str(good)], catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"kvchat: {bad}: not valid JSON (line 1, column 2: Expecting property name enclosed in "
        "double quotes); kvchat imports a kvchat JSON export or bundle, OpenAI-style messages, "
        "a ChatGPT conversations.json or an llm logs.db"
    )
    assert result.stdout.count("\n") == 1 and "(1 message)" in result.stdout


# --- hostile and broken files --------------------------------------------------------------


BROKEN: dict[str, tuple[bytes, str]] = {
    "malformed": (b'{"messages": [', "not valid JSON"),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not UTF-8 text"),
    "unknown role": (
        json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}
        ).encode(),
        "message 2 has an unknown role 'wizard'",
    ),
    "missing content": (json.dumps([{"role": "user"}]).encode(), "message 1 has no content"),
    "lone surrogate": (b'[{"role": "user", "content": "\\ud800"}]', "invalid Unicode"),
    "system later": (
        json.dumps([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]).encode(),
        "system message after the conversation started",
    ),
    "kvchat without session": (
        json.dumps({"format": "kvchat.session/1", "messages": []}).encode(),
        "has no 'session' field",
    ),
    "kvchat bad setting": (
        json.dumps(
            {
                "format": "kvchat.session/1",
                "session": {"title": "t", "settings": {"temperature": "hot"}},
                "messages": [],
            }
        ).encode(),
        "session.settings.temperature has an invalid value",
    ),
    "kvchat tools off not a list": (
        json.dumps(
            {
                "format": "kvchat.session/1",
                "session": {"title": "t", "settings": {"tools_off": "calc.add"}},
                "messages": [],
            }
        ).encode(),
        "session.settings.tools_off has an invalid value 'calc.add'",
    ),
    "kvchat tools always too many": (
        json.dumps(
            {
                "format": "kvchat.session/1",
                "session": {"title": "t", "settings": {"tools_always": ["t.x"] * 513}},
                "messages": [],
            }
        ).encode(),
        "session.settings.tools_always has an invalid value ['t.x', 't.x',",
    ),
    "kvchat tools off with an escape": (
        json.dumps(
            {
                "format": "kvchat.session/1",
                "session": {"title": "t", "settings": {"tools_off": ["a\x1b]0;x\x07"]}},
                "messages": [],
            }
        ).encode(),
        "session.settings.tools_off has an invalid value",
    ),
    "chatgpt cycle": (
        json.dumps(
            [
                {
                    "mapping": {
                        "a": {"id": "a", "parent": "b", "message": None},
                        "b": {"id": "b", "parent": "a", "message": None},
                    },
                    "current_node": "a",
                }
            ]
        ).encode(),
        "the parent links form a cycle",
    ),
    "chatgpt bad role": (
        json.dumps(
            {
                "mapping": {
                    "a": {
                        "id": "a",
                        "parent": None,
                        "message": {"author": {"role": "oracle"}, "content": {}},
                    }
                },
                "current_node": "a",
            }
        ).encode(),
        "unknown role 'oracle'",
    ),
    "not a format": (b'{"hello": "world"}', "not a format kvchat imports"),
    "second message ok, first broken": (
        json.dumps([{"role": "user", "content": 5}, {"role": "user", "content": "ok"}]).encode(),
        "message 1.content is neither text nor a list of parts",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_file_imports_nothing_and_says_why_on_one_line(service, tmp_path, case):
    data, expected = BROKEN[case]
    path = tmp_path / "broken.json"
    path.write_bytes(data)
    with pytest.raises(BadFile) as raised:
        import_file(service, path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and expected in message
    assert "\n" not in message
    assert service.sessions.list_sessions() == []
    assert service.store.get_meta("import:" + "0" * 64) is None


def test_one_bad_conversation_in_an_archive_imports_none_of_it(service, tmp_path):
    broken = chatgpt_conversation("c-2", "Two", "a2")
    broken["mapping"]["u2"]["message"]["author"] = {"role": "narrator"}
    path = write_json(tmp_path / "c.json", [chatgpt_conversation("c-1", "One", "a2"), broken])
    with pytest.raises(BadFile, match="unknown role 'narrator'"):
        import_file(service, path)
    assert service.sessions.list_sessions() == []


def test_sizes_and_counts_are_bounded_before_reading(service, tmp_path, monkeypatch):
    path = write_json(tmp_path / "big.json", [{"role": "user", "content": "x" * 4000}] * 3)
    monkeypatch.setattr(common, "MAX_MESSAGES", 2)
    monkeypatch.setattr("kvchat.transfer.openai.MAX_MESSAGES", 2)
    with pytest.raises(BadFile, match="3 messages is over the 2 limit"):
        import_file(service, path)
    monkeypatch.setattr("kvchat.transfer.importer.MAX_JSON_BYTES", 1000)
    with pytest.raises(BadFile, match="over the 1,000-byte JSON limit"):
        import_file(service, path)
    with pytest.raises(BadFile, match="is a directory"):
        import_file(service, tmp_path)
    assert service.sessions.list_sessions() == []


BUNDLED_SETTINGS = {"tools_off": ["calc.echo"], "tools_always": ["calc.add"], "seed": 3}


def text_bundle(service: ChatService, tmp_path: Path) -> Path:
    """A bundle of a session that has no KV (text only): no model needed."""
    session = service.sessions.new_session("Bundle me")
    service.sessions.configure(session.id, settings=BUNDLED_SETTINGS)
    service.sessions.add_message(session.id, "user", "Hello")
    service.sessions.add_message(session.id, "assistant", "Hi!")
    written = write_bundle(service, session.id, tmp_path / "text.kvchat")
    assert written.reason == "the session has no saved KV" and written.kv_tokens == 0
    return written.path


def rezip(source: Path, target: Path, extra: dict[str, bytes], compress: bool = False) -> Path:
    """``source``'s members plus ``extra`` (written under exactly the names given)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            new.writestr(info, old.read(info))
        for name, data in extra.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            new.writestr(info, data)
    return target


def test_a_text_only_bundle_round_trips_and_says_why_it_has_no_kv(service, tmp_path):
    path = text_bundle(service, tmp_path)
    [item] = import_file(service, path).sessions
    assert item.new and item.kv_tokens == 0
    assert item.kv_reason == "the bundle carries no KV (the session has no saved KV)"
    assert texts(service, item.session) == [("user", "Hello", False), ("assistant", "Hi!", False)]
    assert service.store.get_session(item.session).settings == BUNDLED_SETTINGS


@pytest.mark.parametrize(
    "name", ["../escaped.txt", "/tmp/kvchat-absolute-escape.txt", "kv/../../x.kvc"]
)
def test_a_bundle_with_a_path_member_writes_nothing_anywhere(service, tmp_path, name):
    source = text_bundle(service, tmp_path)
    work = tmp_path / "deep" / "er"
    work.mkdir(parents=True)
    hostile = rezip(source, work / "hostile.kvchat", {name: b"owned"})
    before = {p for p in tmp_path.rglob("*")}
    sessions = len(service.sessions.list_sessions())

    with pytest.raises(BadFile, match="a member kvchat does not write"):
        import_file(service, hostile)

    assert {p for p in tmp_path.rglob("*")} == before
    assert not Path("/tmp/kvchat-absolute-escape.txt").exists()
    assert len(service.sessions.list_sessions()) == sessions


def test_a_zip_bomb_is_refused_before_it_is_read(service, tmp_path):
    source = text_bundle(service, tmp_path)
    with zipfile.ZipFile(source) as old:
        manifest = json.loads(old.read("manifest.json"))
    bomb = tmp_path / "bomb.kvchat"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr("manifest.json", json.dumps(manifest))
        with new.open("messages.json", "w") as member:
            for _ in range(64):
                member.write(bytes(1 << 20))  # 64 MiB of zeros in about 64 KiB
    with pytest.raises(
        BadFile, match=r"messages.json would unpack 67,108,864 bytes from .*zip bomb"
    ):
        import_file(service, bomb)
    assert len(service.sessions.list_sessions()) == 1  # the bundled session, not an imported one


def test_a_member_claiming_a_huge_size_is_refused_before_it_is_read(service, tmp_path):
    source = text_bundle(service, tmp_path)
    padded = rezip(source, tmp_path / "huge.kvchat", {"kv/000000.kvc": b"x" * 64})
    data = bytearray(padded.read_bytes())
    entry = data.find(b"PK\x01\x02")  # the central directory: find this member's entry
    while data[entry + 46 : entry + 46 + 13] != b"kv/000000.kvc":
        entry = data.find(b"PK\x01\x02", entry + 4)
        assert entry > 0
    struct.pack_into("<L", data, entry + 24, 0xF0000000)  # uncompressed size: 3.75 GiB
    padded.write_bytes(bytes(data))
    with pytest.raises(
        BadFile, match=r"kv/000000.kvc would unpack to 4,026,531,840 bytes .*refused"
    ):
        import_file(service, padded)


def test_a_bundle_member_the_manifest_does_not_list_is_refused(service, tmp_path):
    source = text_bundle(service, tmp_path)
    extra = rezip(source, tmp_path / "extra.kvchat", {"kv/000000.kvc": b"unlisted"})
    with pytest.raises(BadFile, match="kv/000000.kvc is in the archive but not in its manifest"):
        import_file(service, extra)


def test_not_a_zip_and_an_empty_file_are_one_line_each(service, tmp_path):
    for name, data, expected in (
        ("cut.kvchat", b"PK\x03\x04" + bytes(30), "not a readable zip archive"),
        ("empty.json", b"", "not valid JSON"),
        ("fake.db", b"SQLite format 3\x00" + bytes(100), "cannot be read"),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(KvchatError, match=expected):
            import_file(service, path)
    assert service.sessions.list_sessions() == []


def test_a_file_in_no_format_kvchat_reads_names_the_formats_it_does(kvhome, tmp_path):
    """Issue 22.17: `kvchat import notes.md` said only 'not valid JSON'."""
    notes = tmp_path / "notes.md"
    notes.write_text("# My notes\n\n- one\n")
    result = CliRunner().invoke(main, ["import", str(notes)])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert str(notes) in line and "ChatGPT conversations.json" in line and "llm logs.db" in line
