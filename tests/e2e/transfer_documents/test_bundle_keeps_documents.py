"""A bundle carries a conversation's documents: imported into an empty home, the session has
them placed as they were (one at the start, one with a later question), so its prompt is the
original's token for token, the bundle's KV restores from disk, and the next turn decodes
only its own question, replying as a full prefill does."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from kvchat.config import load_settings
from kvchat.service.chat import open_service
from kvchat.service.documents import DocumentShelf

FLAGS = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "2048", "--json"]
NEXT = "Which room has the amber valve?"


def notes(topic: str, lines: int) -> str:
    """A plain-text document of about 25 tokens a line."""
    return "\n".join(
        f"{topic} {i}: the valve in room {i * 7 % 101} opens at {i * 13 % 97} kPa."
        for i in range(lines)
    )


def rendered(home: Path, session_id: str) -> list[dict[str, str]]:
    """The messages the template renders for the session (its system message with the start
    documents' block, each message with the block of those that came with it)."""
    with open_service(load_settings(), home=home) as chat:
        shelf = DocumentShelf(chat.store)
        session = chat.store.get_session(session_id)
        return shelf.head(session, session.system_prompt) + shelf.chat(
            session_id, chat.store.messages(session_id)
        )


def test_a_bundle_with_documents_resumes_in_an_empty_home_from_its_kv(
    cli, copy_home, tmp_path: Path
) -> None:
    start_doc, later_doc = tmp_path / "valves.txt", tmp_path / "rooms.md"
    start_doc.write_text(notes("Valve", 12) + "\n")
    later_doc.write_text("# Rooms\n" + notes("Room", 6) + "\n")
    source = tmp_path / "source"
    first = cli(source, "ask", "--new", "-a", str(start_doc), "Which valve opens first?", *FLAGS)
    session = first.json["session"]
    cli(source, "ask", "--session", session, "-a", str(later_doc), "And the rooms?", *FLAGS)

    bundle = tmp_path / "docs.kvchat"
    cli(source, "export", session, "--format", "bundle", "-o", str(bundle))
    with zipfile.ZipFile(bundle) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        exported = json.loads(zf.read("messages.json"))
    carried = exported["documents"]
    assert [d["name"] for d in carried] == ["valves.txt", "rooms.md"]
    assert carried[0]["message"] is None
    assert exported["messages"][carried[1]["message"]]["content"] == "And the rooms?"
    assert carried[0]["text"] == notes("Valve", 12) + "\n"  # as read from the file
    assert manifest["kv"] is not None

    home = tmp_path / "empty"
    [item] = cli(home, "import", str(bundle), "--json", "--n-ctx", "2048").json["sessions"]
    assert item["documents"] == 2 and item["messages"] == 4
    kv_tokens = manifest["kv"]["n_tokens"]
    assert (item["kv"]["tokens"], item["kv"]["reason"]) == (kv_tokens, None)
    assert rendered(home, item["session"]) == rendered(source, session)

    baseline_home = copy_home(home, "baseline")
    original_home = copy_home(source, "original")
    resumed = cli(home, "ask", "--session", item["session"], NEXT, *FLAGS).json
    baseline = cli(
        baseline_home, "ask", "--session", item["session"], NEXT, "--no-restore", *FLAGS
    ).json
    original = cli(original_home, "ask", "--session", session, NEXT, *FLAGS).json

    assert resumed["restore"]["from"] == "disk" and resumed["restore"]["reason"] is None
    assert resumed["tokens"]["reused"] == kv_tokens
    assert 0 < resumed["tokens"]["decoded"] < 32
    prompts: dict[str, Any] = {
        "resumed": resumed["tokens"]["prompt"],
        "baseline": baseline["tokens"]["prompt"],
        "original": original["tokens"]["prompt"],
    }
    assert len(set(prompts.values())) == 1, prompts
    assert baseline["tokens"]["decoded"] == baseline["tokens"]["prompt"]
    assert original["tokens"]["reused"] == kv_tokens
    assert resumed["reply"] == baseline["reply"] == original["reply"]
