"""On a machine without a GPU the plan is for the machine as it is: the RAM a model takes
grows with the context by the KV, and the speed scales with the weights."""

from __future__ import annotations

import pytest

from kvchat.paths import bundled_model_path
from kvchat.planner import read_gguf
from kvchat.planner.catalog import find_entry, info_from_catalog, load_catalog
from kvchat.planner.cpu import Measured, cpu_fit, ram_needed
from kvchat.planner.kv_bytes import kv_bytes_per_token


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
