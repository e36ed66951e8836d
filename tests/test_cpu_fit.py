"""Issue 22.12: on a machine without a GPU, the picker and `kvchat models plan` plan for the
machine as it is: the RAM a model takes at a context and the RAM free, and the tokens/s to
expect, scaled from the engine probe's measurement on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.engine.api import EngineConfig
from kvchat.engine.probe import ProbeBook, measured_speed, run_probe
from kvchat.paths import bundled_model_path
from kvchat.planner import read_gguf
from kvchat.planner.catalog import find_entry, info_from_catalog, load_catalog
from kvchat.planner.cpu import Measured, cpu_fit, ram_needed
from kvchat.planner.kv_bytes import kv_bytes_per_token
from tests.conftest import run_cli


def test_ram_grows_with_the_context_by_the_kv_and_speed_scales_with_the_weights() -> None:
    small = read_gguf(bundled_model_path())
    big = info_from_catalog(find_entry("qwen2.5-1.5b", load_catalog()))
    per_token = kv_bytes_per_token(big, "f16").total
    grown = ram_needed(big, 16384) - ram_needed(big, 8192)
    assert grown >= 8192 * per_token  # the KV, and the compute buffer that grows with it
    assert ram_needed(big, 8192) > big.weight_bytes + 8192 * per_token
    measured = Measured(tok_s=150.0, model_bytes=small.weight_bytes, model_name="small")
    fit = cpu_fit(big, 8192, measured)
    assert fit.tok_s == pytest.approx(150.0 * small.weight_bytes / big.weight_bytes)
    assert "tok/s expected" in fit.line() and "of RAM" in fit.line()
    assert cpu_fit(big, 8192, None).tok_s is None


@pytest.mark.e2e
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
