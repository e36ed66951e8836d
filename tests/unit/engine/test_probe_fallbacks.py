"""The engine probe's choices, model-free: fallbacks turn off one risky option at a time,
the fastest thread count is the measured one, and a GPU out of memory retries with less
context, then fewer layers."""

from __future__ import annotations

from dataclasses import replace

from kvchat.engine.api import EngineConfig
from kvchat.engine.probe import (
    Trial,
    fastest,
    thread_candidates,
)
from kvchat.paths import bundled_model_path
from kvchat.planner.defaults import DefaultsChoice, retry_plan

# --- the choice ------------------------------------------------------------------------------


def test_fallbacks_turn_off_one_risky_option_at_a_time():
    wanted = Trial(repack=True, flash_attn=True, n_gpu_layers=-1, type_k="q8_0", type_v="q8_0")
    trials = wanted.fallbacks(repack_fixed=False, gpu=True)
    assert [(t.repack, t.flash_attn, t.n_gpu_layers) for t in trials] == [
        (True, True, -1),
        (False, True, -1),
        (False, False, -1),
        (False, False, 0),
    ]
    # Flash attention off needs an f16 V cache; K may stay quantized.
    assert (trials[2].type_k, trials[2].type_v) == ("q8_0", "f16")
    # repack = "on" is the user's: never turned off by the probe.
    assert all(t.repack for t in wanted.fallbacks(repack_fixed=True, gpu=True))
    # A build without GPU offload has nothing to turn off there.
    assert all(t.n_gpu_layers == -1 for t in wanted.fallbacks(repack_fixed=False, gpu=False))


def test_the_fastest_thread_count_is_the_measured_one():
    speeds = {"4": {"prefill": 300.0, "generate": 9.0}, "2": {"prefill": 200.0, "generate": 21.0}}
    assert fastest(speeds, "generate") == 2
    assert fastest(speeds, "prefill") == 4
    assert fastest({}, "generate") is None
    assert thread_candidates(2) == [2, 1]
    assert thread_candidates(16) == [16, 8, 4]


# --- a GPU that cannot open the model -------------------------------------------------------


def _gpu_choice(**values) -> DefaultsChoice:
    base = dict(
        n_ctx=32768,
        type_k="f16",
        type_v="f16",
        flash_attn=True,
        n_gpu_layers=-1,
        device="gpu",
        sources={"n_ctx": "plan", "n_gpu_layers": "plan"},
    )
    return DefaultsChoice(**{**base, **values})


def test_a_gpu_out_of_memory_retries_with_less_context_then_fewer_layers():
    config = EngineConfig(bundled_model_path(), n_ctx=32768, n_gpu_layers=-1)
    oom = "could not load model: CUDA error: out of memory (cudaMalloc failed)"
    smaller = retry_plan(_gpu_choice(), config, oom)
    assert smaller is not None and smaller.n_ctx == 16384 and smaller.n_gpu_layers == -1
    assert "retried with n_ctx 16,384" in smaller.note
    # At the smallest useful context: fewer layers (SmolLM2 has 30: 31 with the output).
    floor = replace(config, n_ctx=4096)
    fewer = retry_plan(_gpu_choice(n_ctx=4096), floor, oom)
    assert fewer is not None and fewer.n_ctx == 4096 and fewer.n_gpu_layers == 15
    assert fewer.device == "partial"
    none = retry_plan(_gpu_choice(n_ctx=4096), replace(floor, n_gpu_layers=1), oom)
    assert none is not None and none.n_gpu_layers == 0 and none.device == "cpu"
    # What the user set stays; a failure that is not the GPU's is not retried.
    mine = _gpu_choice(sources={"n_ctx": "flag", "n_gpu_layers": "flag"})
    assert retry_plan(mine, config, oom) is None
    assert retry_plan(_gpu_choice(), config, "could not load model: not a GGUF file") is None
    assert retry_plan(_gpu_choice(), replace(config, n_gpu_layers=0), oom) is None
