"""A model in another app's store is named as the user found it (issue 41, item 4): `kvchat
models plan` and --model take its store name with or without the store's prefix, a miss
suggests the nearest name, and what a turn records names the store's model, never its blob."""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from kvchat.store import Store
from tests.conftest import FAST, run_cli_here
from tests.unit.planner.test_model_stores import stores, tiny

__all__ = ["stores", "tiny"]  # fixtures shared with the module they come from


def test_plan_and_model_take_store_names_with_or_without_prefix(stores: Path, kvhome: Path) -> None:
    env = {"HOME": os.environ["HOME"]}
    for spec in ("ollama:tiny", "ollama:tiny:latest", "tiny", "tiny:latest", "someone/helper:v1"):
        plan = run_cli_here(kvhome, "models", "plan", spec, env=env, check=False)
        assert plan.returncode == 0, (spec, plan.stderr)
        assert "llama" in plan.stdout, spec
    missed = run_cli_here(kvhome, "models", "plan", "tiyn", env=env, check=False)
    assert missed.returncode == 2
    assert missed.stderr.count("\n") == 1
    assert "did you mean 'ollama:tiny:latest'?" in missed.stderr
    store_miss = run_cli_here(kvhome, "--model", "ollama:tinny", "ask", "Hi", env=env, check=False)
    assert store_miss.returncode == 2
    assert "did you mean 'ollama:tiny:latest'?" in store_miss.stderr
    reply = run_cli_here(kvhome, "--model", "tiny", "ask", "--new", "Hi", "--json", *FAST, env=env)
    assert reply.json["tokens"]["reused"] == 0 and reply.json["tokens"]["generated"] > 0


def test_a_turn_records_the_store_name_not_the_blob(stores: Path, kvhome: Path) -> None:
    service = ChatService(load_settings(model="ollama:tiny", max_tokens=4, n_threads=1))
    try:
        first = service.start("Hi")
        assert service.models.loaded_name == "ollama:tiny:latest"
        remembered = service.models.session_model(first.session_id)
        assert remembered is not None and remembered.name == "ollama:tiny:latest"
        assert remembered.path.name.startswith("sha256-")
        # The reply's kept figures (F3, after a restart too) name the model the same way.
        assert first.message_id is not None
        figures = service.sessions.figures(first.message_id)
        assert figures is not None and figures.model == "ollama:tiny:latest"
        store: Store = service.store
        row = store.get_session_model(first.session_id)
        assert row is not None and row.model_name == "ollama:tiny:latest"
        # A row written before store names (the blob's file name) is named as now.
        store.set_session_model(first.session_id, row.model_path, Path(row.model_path).stem)
        again = service.models.session_model(first.session_id)
        assert again is not None and again.name == "ollama:tiny:latest"
    finally:
        service.close()
