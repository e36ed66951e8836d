"""Hostile and odd imports: nesting that would make a parser
recurse, settings out of the CLI's ranges, a directory, files with no text."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import load_settings
from kvchat.service.chat import ChatService, open_service
from kvchat.transfer import BadFile, import_file
from kvchat.transfer.common import MAX_JSON_DEPTH, json_depth
from tests.helpers import llm_logs_db


@pytest.fixture
def service(kvhome: Path) -> Iterator[ChatService]:
    with open_service(load_settings()) as chat:
        yield chat


def _one_line_refusal(result, *expected: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: "), result.stderr
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0]
    return lines[0]


def _sessions(kvhome: Path) -> int:
    path = kvhome / "kvchat.db"
    if not path.exists():
        return 0
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT count(*) FROM sessions").fetchone()[0]
    finally:
        db.close()


def test_a_deeply_nested_llm_payload_is_one_line(kvhome: Path, tmp_path: Path):
    path = llm_logs_db(tmp_path / "logs.db")
    db = sqlite3.connect(path)
    (rowid,) = db.execute("SELECT rowid FROM parts WHERE type='text' LIMIT 1").fetchone()
    with db:
        db.execute("UPDATE parts SET text=NULL, payload=? WHERE rowid=?", ("[" * 100_000, rowid))
    db.close()
    result = CliRunner().invoke(main, ["import", str(path)])
    _one_line_refusal(result, str(path), "100,000 levels deep")
    assert _sessions(kvhome) == 0


@pytest.mark.parametrize(
    "document",
    [
        "[" * 100_000,  # not even closed
        "[" * 5_000 + "]" * 5_000,  # valid JSON, nested past any format's need
        '{"messages": ' + '{"a": ' * 2_000 + "1" + "}" * 2_000 + "}",
    ],
    ids=["unclosed", "valid", "objects"],
)
def test_deep_json_is_refused_before_it_is_parsed(service, tmp_path, document):
    path = tmp_path / "deep.json"
    path.write_text(document)
    with pytest.raises(BadFile) as raised:
        import_file(service, path)
    assert "levels deep" in str(raised.value) and "\n" not in str(raised.value)


def test_depth_is_counted_outside_strings():
    text = json.dumps({"a": ["[[[[{{{{", {"b": "]]]]"}]})
    assert json_depth(text) == 3
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(nested) == MAX_JSON_DEPTH


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"temperature": 100}, "temperature must be from 0 to 2"),
        ({"top_p": 0}, "top_p must be more than 0"),
        ({"max_tokens": 0}, "max_tokens must be a whole number, at least 1"),
        ({"seed": -1}, "seed must be a whole number, 0 or more"),
    ],
)
def test_imported_settings_have_the_cli_ranges(service, tmp_path, settings, expected):
    path = tmp_path / "s.json"
    document = {
        "format": "kvchat.session/1",
        "session": {"title": "t", "settings": settings},
        "messages": [{"role": "user", "content": "hi"}],
    }
    path.write_text(json.dumps(document))
    with pytest.raises(BadFile, match=expected):
        import_file(service, path)
    assert service.sessions.list_sessions() == []


def test_importing_a_directory_is_one_line(kvhome: Path, tmp_path: Path):
    folder = tmp_path / "exports"
    folder.mkdir()
    result = CliRunner().invoke(main, ["import", str(folder)])
    _one_line_refusal(result, "is a directory")
    assert "Usage:" not in result.output


def test_imports_with_no_text_make_no_empty_sessions(kvhome: Path, tmp_path: Path):
    image_only = tmp_path / "images.json"
    image_only.write_text(
        json.dumps(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                },
                {"role": "assistant", "content": None, "tool_calls": []},
            ]
        )
    )
    result = CliRunner().invoke(main, ["import", str(image_only)])
    _one_line_refusal(result, "no text to import")
    assert _sessions(kvhome) == 0

    chatgpt = tmp_path / "conversations.json"
    text_node = {
        "id": "t",
        "parent": None,
        "message": {
            "author": {"role": "user"},
            "content": {"content_type": "text", "parts": ["Hello"]},
        },
    }
    image_node = {
        "id": "i",
        "parent": None,
        "message": {
            "author": {"role": "user"},
            "content": {"content_type": "multimodal_text", "parts": [{"asset": "x"}]},
        },
    }
    chatgpt.write_text(
        json.dumps(
            [
                {"title": "Text", "mapping": {"t": text_node}, "current_node": "t"},
                {"title": "Picture", "mapping": {"i": image_node}, "current_node": "i"},
            ]
        )
    )
    result = CliRunner().invoke(main, ["import", str(chatgpt)])
    assert result.exit_code == 0, result.output
    assert _sessions(kvhome) == 1  # the picture-only conversation made no empty session

    # A kvchat export with no messages at all: nothing to import, said on one line.
    mixed = tmp_path / "mixed.json"
    mixed.write_text(
        json.dumps(
            {
                "format": "kvchat.session/1",
                "session": {"title": "Nothing"},
                "messages": [],
            }
        )
    )
    result = CliRunner().invoke(main, ["import", str(mixed)])
    _one_line_refusal(result, "no text to import")
    assert _sessions(kvhome) == 1
