"""Builders the test files share: services over a home, and files other apps write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvchat.config import load_settings
from kvchat.service.chat import ChatService

# What most model tests run with: short, greedy (temperature 0) and one thread, so replies
# repeat exactly and two tests running side by side do not fight over the cores.
GREEDY: dict[str, Any] = {"n_ctx": 1024, "temperature": 0.0, "max_tokens": 12, "n_threads": 1}


def greedy_service(home: Path, model: Path | None = None, **settings: Any) -> ChatService:
    """A service over ``home`` on ``model`` (default: the bundled one) with :data:`GREEDY`
    settings, each replaceable by ``settings``. The caller closes it."""
    if model is not None:
        settings["model"] = str(model)
    return ChatService(load_settings(**(GREEDY | settings)), home=home)


def llm_logs_db(path: Path) -> Path:
    """A logs.db written by llm itself: two logged conversations through its Response API (llm
    0.36's thread/message tables), plus rows in the older conversations/responses tables as
    llm wrote them before (its migrations create both)."""
    import llm
    import sqlite_utils
    from llm.migrations import migrate

    class Echo(llm.Model):
        model_id = "echo"
        can_stream = False

        def execute(self, prompt, stream, response, conversation):
            yield f"echo: {prompt.prompt}"

    db = sqlite_utils.Database(path)
    migrate(db)
    model = Echo()
    conversation = model.conversation()
    for text in ("Hello there", "Second question"):
        response = conversation.prompt(text, system="Be terse.")
        response.text()
        response.log_to_db(db)
    single = model.prompt("Lone prompt")
    single.text()
    single.log_to_db(db)
    db["conversations"].insert({"id": "01old", "name": "Old chat", "model": "gpt-4o-mini"})
    db["responses"].insert_all(
        {
            "id": f"01old-{n}",
            "model": "gpt-4o-mini",
            "prompt": prompt,
            "system": "You are a calculator.",
            "prompt_json": None,
            "options_json": "{}",
            "response": reply,
            "response_json": None,
            "conversation_id": "01old",
            "duration_ms": 5,
            "datetime_utc": f"2024-05-01T10:0{n}:00.000000",
        }
        for n, (prompt, reply) in enumerate((("2+2?", "4"), ("3+3?", "6")))
    )
    db.close()
    return path
