"""A model in another app's store (Ollama's here) replies and resumes by its store name,
read where it is; the real `kvchat` CLI."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import FAST, run_cli_here
from tests.unit.planner.test_model_stores import stores, tiny

__all__ = ["stores", "tiny"]  # fixtures shared with the module they come from


def test_a_model_in_ollamas_store_replies_and_resumes_by_name(stores: Path, kvhome: Path) -> None:
    env = {"HOME": os.environ["HOME"]}
    listed = run_cli_here(kvhome, "models", "list", "--local", "--json", env=env).json["models"]
    row = next(r for r in listed if r["name"] == "ollama:tiny:latest")
    assert row["usable"] and row["attention"] == "GQA" and row["architecture"] == "llama"
    first = run_cli_here(
        kvhome, "--model", "ollama:tiny", "ask", "--new", "Hi", "--json", *FAST, env=env
    )
    report = first.json
    assert report["tokens"]["reused"] == 0
    again = run_cli_here(
        kvhome,
        "--model",
        "ollama:tiny:latest",
        "ask",
        "--session",
        report["session"],
        "And then?",
        "--json",
        *FAST,
        env=env,
    ).json
    assert again["restore"]["from"] == "disk"
    assert again["tokens"]["reused"] == again["restore"]["tokens"] > 0
    missing = run_cli_here(kvhome, "--model", "ollama:nothing", "ask", "Hi", env=env, check=False)
    assert missing.returncode == 2 and "models list --local" in missing.stderr
