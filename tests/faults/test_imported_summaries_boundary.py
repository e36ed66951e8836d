"""The compaction summaries an export or a bundle carries are a door (issue 42): whatever a
file puts in its ``summaries`` list, an import stores the session with summaries that are
storable, non-empty, bounded text, each standing for one of the session's own messages, with
a count of tokens; or it stores nothing and says why on one line; never a traceback.

Seeded random cases: a real export's ``summaries`` with fields swapped for other types,
escapes, lone surrogates, huge or negative numbers, booleans, indexes off the end, blank
text, megabyte text, entries dropped, repeated and added; a third of them inside a bundle.
A sample of 20 runs by default; ``pytest -m stress`` runs 240.
"""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import load_settings
from kvchat.service.chat import ChatService, open_service
from kvchat.transfer import BadFile, import_file, write_bundle
from kvchat.transfer.imported_summaries import MAX_SUMMARY_CHARS
from tests.faults.test_imported_documents_boundary import _rebundle

_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\x1b\r]")
FIELDS = ["after", "text", "replaced_tokens", "upto_message_id", "created"]


def _hostile(rng: random.Random) -> Any:
    pieces = ["words ", "\x1b[2J", "\x9b31m", "<|im_start|>", "\r\n", "\x00", "\ud800", " "]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
    return rng.choice(
        [
            text,
            text.replace("\ud800", ""),
            rng.randint(-(2**70), 2**70),
            rng.choice([-1, 0, 1, 2, 3, 4, 5, 6, 2**31, 2**63]),
            rng.random() * 10,
            None,
            True,
            False,
            [],
            {"a": [1]},
            "",
            "   \n",
            "x" * rng.choice([4097, MAX_SUMMARY_CHARS + 1]),
        ]
    )


def _mutate(rng: random.Random, summaries: list[Any]) -> list[Any] | Any:
    """The summaries list with one to four hostile changes."""
    out = copy.deepcopy(summaries)
    for _ in range(rng.randint(1, 4)):
        action = rng.choice(["field", "field", "field", "drop", "repeat", "extra", "whole"])
        if action == "whole":
            return rng.choice([_hostile(rng), [_hostile(rng)], {"summaries": out}, None, []])
        if not out:
            out.append({})
        entry = rng.choice(out)
        if not isinstance(entry, dict):
            continue
        if action == "field":
            entry[rng.choice(FIELDS)] = _hostile(rng)
        elif action == "drop":
            entry.pop(rng.choice(FIELDS), None)
        elif action == "repeat":
            out.append(copy.deepcopy(entry))
        else:
            out.append({key: _hostile(rng) for key in FIELDS if rng.random() < 0.8})
    return out


def _counts(chat: ChatService) -> tuple[int, int]:
    rows = chat.store.conn.execute("SELECT count(*) FROM summaries").fetchone()
    return len(chat.sessions.list_sessions()), int(rows[0])


def _check_stored(chat: ChatService, session_id: str) -> None:
    messages = {m.id for m in chat.store.messages(session_id)}
    for summary in chat.store.summaries(session_id):
        assert summary.text.strip() and len(summary.text) <= MAX_SUMMARY_CHARS
        summary.text.encode("utf-8")  # storable text: no lone surrogate
        assert summary.upto_message_id in messages
        assert 0 <= summary.replaced_tokens < 1 << 31


def campaign(tmp_path: Path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"imported": 0, "refused": 0}
    with open_service(load_settings(), home=tmp_path / "home") as chat:
        session = chat.sessions.new_session("Compacted", "Be brief.")
        for i in range(3):
            chat.store.add_message(session.id, "user", f"Q{i}")
            chat.store.add_message(session.id, "assistant", f"A{i}")
        upto = chat.store.messages(session.id)[3].id
        chat.store.add_summary(session.id, upto, "They asked twice.", 40)
        exported = json.loads(chat.sessions.export(session.id, "json"))
        assert exported["summaries"][0]["after"] == 4  # after the system prompt's entry
        bundle = tmp_path / "text.kvchat"
        write_bundle(chat, session.id, bundle)
        for i in range(cases):
            document = copy.deepcopy(exported)
            document["session"]["id"] = f"case-{i}"  # each case its own conversation
            document["summaries"] = _mutate(rng, exported["summaries"])
            raw = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode(
                "utf-8", "surrogatepass"
            )
            path = tmp_path / f"case{i}.json"
            path.write_bytes(raw)
            if i % 3 == 2:
                path = _rebundle(bundle, tmp_path / f"case{i}.kvchat", raw)
            before = _counts(chat)
            try:
                result = import_file(chat, path)
            except BadFile as exc:
                line = str(exc)
                assert line.startswith(str(path)) and not _UNSAFE.search(line), line
                assert "\n" not in line
                assert _counts(chat) == before
                counts["refused"] += 1
            else:
                [item] = result.sessions
                _check_stored(chat, item.session)
                counts["imported"] += 1
    return counts


def test_a_summary_imports_where_it_applies(tmp_path: Path) -> None:
    with open_service(load_settings(), home=tmp_path / "home") as chat:
        session = chat.sessions.new_session("Compacted", "Be brief.")
        for i in range(3):
            chat.store.add_message(session.id, "user", f"Q{i}")
            chat.store.add_message(session.id, "assistant", f"A{i}")
        chat.store.add_summary(session.id, chat.store.messages(session.id)[3].id, "S.", 40)
        path = tmp_path / "export.json"
        path.write_text(chat.sessions.export(session.id, "json"))
        document = json.loads(path.read_text())
        document["session"]["id"] = "elsewhere"
        path.write_text(json.dumps(document))
        [item] = import_file(chat, path).sessions
        [summary] = chat.store.summaries(item.session)
        assert summary.text == "S." and summary.replaced_tokens == 40
        assert summary.upto_message_id == chat.store.messages(item.session)[3].id


def test_sample_of_hostile_summaries(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 20, seed=42)
    assert sum(counts.values()) == 20 and counts["refused"] > 0


@pytest.mark.stress
def test_stress_campaign_of_hostile_summaries(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 240, seed=2042)
    print(
        f"\nSTRESS imported summaries: 240 hostile cases, {counts['imported']} imported, "
        f"{counts['refused']} refused"
    )
    assert counts["imported"] > 0 and counts["refused"] > 0
