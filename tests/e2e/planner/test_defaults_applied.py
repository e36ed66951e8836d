"""The planned defaults reach the model: the service applies the plan when it loads the
model, `ask` prints the plan on stderr, `config` shows values and their sources, and a
catalog model that is not pulled is one clear line. No GPU here: NVML is a fake module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvchat.planner.defaults as defaults
from kvchat.cli import main
from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from tests.conftest import FAST
from tests.unit.planner.test_defaults import BUNDLED


@pytest.fixture(autouse=True)
def home(kvhome: Path) -> Path:
    """Every test: its own KVCHAT_HOME (config file, models dir), no KVCHAT_* from outside."""
    return kvhome


def test_ask_with_a_catalog_model_that_is_not_pulled(home: Path, cli) -> None:
    result = cli(home, "ask", "--model", "llama-3.2-3b", "Hi", check=False)
    assert result.returncode == 2
    assert "kvchat models pull llama-3.2-3b" in result.stderr


# --------------------------------------------------------------------------- shown and applied


def test_config_command_shows_values_and_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "gpu_offload_supported", lambda: True)
    monkeypatch.setenv("KVCHAT_VRAM", "6GiB")
    result = CliRunner().invoke(
        main, ["config", "--json", "--n-ctx", "2048"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = data["settings"]
    assert rows["n_ctx"] == {"value": 2048, "source": "flag"}
    assert rows["flash_attn"] == {"value": True, "source": "plan"}
    assert rows["type_k"]["source"] == "plan" and rows["n_gpu_layers"]["value"] == -1
    assert rows["vram"] == {"value": "6GiB", "source": "env KVCHAT_VRAM"}
    assert rows["temperature"]["source"] == "default"
    assert data["plan"]["device"] == "gpu" and data["model_path"] == str(BUNDLED)

    text = CliRunner().invoke(main, ["config"], catch_exceptions=False).output
    assert "plan: GPU plan for vram 6.00 GiB (env KVCHAT_VRAM)" in text
    assert "n_ctx" in text and "plan" in text


def test_service_applies_the_plan_when_it_loads_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(defaults, "gpu_offload_supported", lambda: True)
    service = ChatService(load_settings(vram="6GiB", n_ctx=256, n_threads=1))
    try:
        engine = service.load_engine()
        assert engine.n_ctx == 256
        assert engine.config.flash_attn and engine.config.type_k == "f16"
        assert engine.config.n_gpu_layers == -1
        assert service.host.fingerprint.flash_attn
        assert service.host.plan_note and service.host.plan_note.startswith(
            "GPU plan for vram 6.00 GiB"
        )
        assert "set by you: n_ctx" in service.host.plan_note
    finally:
        service.close()


def test_ask_prints_the_plan_on_stderr(home: Path, cli) -> None:
    result = cli(home, "ask", "Hi", "--model", "smollm2-135m", *FAST, "--threads", "1")
    assert "plan: CPU (no GPU found" in result.stderr
    assert "n_ctx 1,024 · KV f16 · flash attention off" in result.stderr
