"""The documents an export or a bundle carries are a door: whatever a file puts there, an
import stores the session with documents that are bounded, clean text placed at the start or
at one of its messages, or it stores nothing and says why on one line; never a traceback.

Seeded random cases: a real export's ``documents`` list with fields swapped for other types,
escapes and control characters, lone surrogates, huge numbers, long names, indexes off the
end, repeats, extra entries; a third of them inside a bundle. A sample of 20 runs by
default; ``pytest -m stress`` runs 240.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import load_settings
from kvchat.documents.bounds import MAX_TEXT_CHARS
from kvchat.service.chat import ChatService, open_service
from kvchat.store.documents_sql import DocumentRow
from kvchat.transfer import BadFile, import_file, write_bundle

_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\x1b\r]")
_SHA = re.compile(r"[0-9a-f]{64}")
FIELDS = ["name", "kind", "size", "sha256", "pages", "text", "message"]


def _row(name: str, text: str, kind: str = "text") -> DocumentRow:
    sha = hashlib.sha256(text.encode()).hexdigest()
    return DocumentRow(DocumentRow.key(name, sha), name, kind, len(text.encode()), sha, text)


def _hostile(rng: random.Random) -> Any:
    pieces = ["words ", "\x1b[2J", "\x1b]0;t\x07", "\x9b31m", "<|im_start|>", "\r\n", "\x00"]
    pieces += ["é", "\u202e", "\ufeff", "\t", "\n", "日本", "\ud800", "`" * 9, "</pre>"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
    return rng.choice(
        [
            text,
            text.replace("\ud800", "").replace("\x00", ""),
            rng.randint(-(2**70), 2**70),
            rng.choice([-1, 0, 1, 2, 3, 4, 5, 2**31, 2**63]),
            rng.random() * 10,
            None,
            True,
            [],
            {"a": [1]},
            "f" * rng.choice([63, 64, 65]),
            "x" * rng.choice([4097, MAX_TEXT_CHARS + 1]),
            rng.choice(["text", "markdown", "code", "csv", "html", "pdf", "exe", "TEXT"]),
        ]
    )


def _mutate(rng: random.Random, documents: list[Any]) -> list[Any] | Any:
    """The documents list with one to four hostile changes."""
    out = copy.deepcopy(documents)
    for _ in range(rng.randint(1, 4)):
        action = rng.choice(["field", "field", "field", "drop", "repeat", "extra", "whole"])
        if action == "whole":
            return rng.choice([_hostile(rng), [_hostile(rng)], {"documents": out}])
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


def _rebundle(source: Path, target: Path, messages: bytes) -> Path:
    """``source`` (a text-only bundle) with ``messages.json`` replaced, its manifest agreeing."""
    with zipfile.ZipFile(source) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    manifest["members"]["messages.json"] = {
        "sha256": hashlib.sha256(messages).hexdigest(),
        "size": len(messages),
    }
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("messages.json", messages)
        zf.writestr("manifest.json", json.dumps(manifest))
    return target


def _check_stored(chat: ChatService, session_id: str) -> None:
    messages = {m.id for m in chat.store.messages(session_id)}
    for used in chat.store.session_documents(session_id):
        doc = used.document
        assert not _UNSAFE.search(doc.text) and not _UNSAFE.search(doc.name)
        assert 0 < len(doc.name) <= 4096 and len(doc.text) <= MAX_TEXT_CHARS
        assert _SHA.fullmatch(doc.sha256) and doc.size >= 0
        assert used.message_id is None or used.message_id in messages


def campaign(tmp_path: Path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"imported": 0, "refused": 0}
    with open_service(load_settings(), home=tmp_path / "home") as chat:
        session = chat.sessions.new_session("Docs", "Be brief.")
        start, later = _row("a.txt", "Alpha."), _row("b.md", "# Beta", "markdown")
        chat.store.put_documents([start, later])
        chat.store.attach_documents(session.id, [start.id])
        chat.store.add_message(session.id, "user", "Q1")
        chat.store.add_message(session.id, "assistant", "A1")
        question = chat.store.add_message(session.id, "user", "Q2")
        chat.store.attach_documents(session.id, [later.id], message_id=question.id)
        exported = json.loads(chat.sessions.export(session.id, "json"))
        bundle = tmp_path / "text.kvchat"
        write_bundle(chat, session.id, bundle)
        for i in range(cases):
            document = copy.deepcopy(exported)
            document["session"]["id"] = f"case-{i}"  # each case its own conversation
            document["documents"] = _mutate(rng, exported["documents"])
            raw = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode(
                "utf-8", "surrogatepass"
            )
            path = tmp_path / f"case{i}.json"
            path.write_bytes(raw)
            if i % 3 == 2:
                path = _rebundle(bundle, tmp_path / f"case{i}.kvchat", raw)
            before = (len(chat.sessions.list_sessions()), len(chat.store.documents()))
            try:
                result = import_file(chat, path)
            except BadFile as exc:
                line = str(exc)
                assert line.startswith(str(path)) and not _UNSAFE.search(line), line
                after = (len(chat.sessions.list_sessions()), len(chat.store.documents()))
                assert after == before
                counts["refused"] += 1
            else:
                [item] = result.sessions
                _check_stored(chat, item.session)
                counts["imported"] += 1
    return counts


def test_sample_of_hostile_documents(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 20, seed=39)
    assert sum(counts.values()) == 20 and counts["refused"] > 0


@pytest.mark.stress
def test_stress_campaign_of_hostile_documents(tmp_path: Path) -> None:
    counts = campaign(tmp_path, 240, seed=2039)
    print(
        f"\nSTRESS imported documents: 240 hostile cases, {counts['imported']} imported, "
        f"{counts['refused']} refused, 0 failures"
    )
    assert counts["imported"] > 0 and counts["refused"] > 0
