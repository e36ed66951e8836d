"""On a machine without a GPU, `kvchat models plan` and the picker say the RAM a model takes
and the tokens/s measured on this machine (the engine probe's measurement, scaled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.engine.api import EngineConfig
from kvchat.engine.probe import ProbeBook, measured_speed, run_probe
from kvchat.paths import bundled_model_path
from kvchat.planner import read_gguf
from tests.conftest import run_cli


def test_plan_and_picker_say_ram_and_the_speed_measured_here(
    kvhome: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe_file = tmp_path / "probe.json"
    monkeypatch.setenv("KVCHAT_PROBE_FILE", str(probe_file))
    assert measured_speed() is None
    config = EngineConfig(bundled_model_path(), n_ctx=512, n_threads=1)
    run_probe(config, repack_fixed=False, physical=2, book=ProbeBook(probe_file))
    measured = measured_speed()
    assert (
        measured is not None
        and measured.model_bytes == read_gguf(bundled_model_path()).weight_bytes
    )
    text = run_cli(
        kvhome, "models", "plan", "qwen2.5-1.5b", env={"KVCHAT_PROBE_FILE": str(probe_file)}
    ).stdout
    assert "on this machine's CPU" in text and "GiB free" in text
    assert f"from {measured.tok_s:.0f} tok/s measured here" in text

    from kvchat.config import load_settings
    from kvchat.service.chat import ChatService

    service = ChatService(load_settings())
    try:
        choices = {c.name: c for c in service.models.model_choices()}
    finally:
        service.close()
    assert (
        "of RAM" in choices["qwen2.5-1.5b"].fit and "tok/s expected" in choices["qwen2.5-1.5b"].fit
    )
