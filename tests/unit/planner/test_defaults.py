"""Context settings planned for the GPU found (or the CPU), explicit values winning, and
``--model NAME|PATH``.

No GPU here: NVML is a fake module, GPU offload is monkeypatched where a plan must apply."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import kvchat.planner.defaults as defaults
from kvchat.config import Settings, load_settings
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path, models_dir
from kvchat.planner import find_entry, info_from_catalog, load_catalog, read_gguf
from kvchat.planner.defaults import AUTO_CTX_CAP, GOOD_CTX, GpuBudget, find_budget, plan_defaults
from kvchat.planner.model_lookup import model_path
from kvchat.planner.plan import GiB, PlanConfig, max_context, memory_at

BUNDLED = bundled_model_path()


@pytest.fixture(autouse=True)
def home(kvhome: Path) -> Path:
    """Every test: its own KVCHAT_HOME (config file, models dir), no KVCHAT_* from outside."""
    return kvhome


def catalog_info(name: str) -> Any:
    entry = find_entry(name, load_catalog())
    assert entry is not None
    return info_from_catalog(entry)


def gpu(gib: float) -> GpuBudget:
    return GpuBudget("nvml", int(gib * GiB), name="Test GPU", total_bytes=int(gib * GiB))


def plan(settings: Settings, info: Any, gib: float) -> defaults.DefaultsChoice:
    return plan_defaults(settings, info=info, budget=gpu(gib), offload=True)


# --------------------------------------------------------------------------- the decision


def test_cpu_keeps_todays_defaults() -> None:
    choice = plan_defaults(load_settings(), budget=None)
    assert (choice.n_ctx, choice.type_k, choice.type_v, choice.flash_attn) == (
        8192,
        "f16",
        "f16",
        False,
    )
    assert choice.device == "cpu"
    assert set(choice.sources.values()) == {"default"}
    assert choice.note.startswith("CPU (no GPU found") and "flash attention off" in choice.note


def test_bundled_model_on_6_gib_gets_its_trained_context_f16_and_flash_attention() -> None:
    assert BUNDLED is not None
    choice = plan(load_settings(), read_gguf(BUNDLED), 6)
    assert choice.values == {
        "n_ctx": 8192,
        "type_k": "f16",
        "type_v": "f16",
        "flash_attn": True,
        "n_gpu_layers": -1,
    }
    assert choice.device == "gpu"
    assert all(choice.sources[n] == "plan" for n in defaults.PLANNED_FIELDS)
    assert choice.vram_total is not None and choice.vram_total <= 6 * GiB
    assert choice.note.startswith("GPU plan for Test GPU") and "n_ctx 8,192" in choice.note


@pytest.mark.parametrize("name", [e.name for e in load_catalog()])
def test_every_catalog_model_gets_a_plan_that_fits_6_gib(name: str) -> None:
    info = catalog_info(name)
    choice = plan(load_settings(), info, 6)
    assert choice.device in ("gpu", "partial")
    assert choice.vram_total is not None and choice.vram_total <= 6 * GiB
    target = min(info.context_length, AUTO_CTX_CAP)
    cfg = PlanConfig(vram_bytes=6 * GiB, type_k="f16", type_v="f16")
    if choice.type_k != "f16":  # a quantized cache only when f16 does not reach the target
        assert max_context(info, -1, cfg, limit=target) < target
    if choice.type_k == "q4_0":  # and 4-bit only when q8_0 falls short of GOOD_CTX
        q8 = PlanConfig(vram_bytes=6 * GiB, type_k="q8_0", type_v="q8_0")
        assert max_context(info, -1, q8, limit=target) < GOOD_CTX
    assert 0 < choice.n_ctx <= target


def test_examples_from_the_catalog_on_6_gib() -> None:
    qwen = plan(load_settings(), catalog_info("qwen2.5-1.5b"), 6)
    assert (qwen.n_ctx, qwen.type_k, qwen.n_gpu_layers) == (32768, "f16", -1)
    llama = plan(load_settings(), catalog_info("llama-3.1-8b"), 6)
    assert llama.type_k == llama.type_v == "q8_0" and llama.flash_attn
    assert GOOD_CTX <= llama.n_ctx < 32768 and llama.n_gpu_layers == -1


def test_partial_offload_when_the_weights_leave_too_little_room() -> None:
    info = catalog_info("llama-3.1-8b")
    choice = plan(load_settings(), info, 4)
    assert choice.device == "partial"
    assert 0 < choice.n_gpu_layers <= info.n_layer
    assert choice.n_ctx == 8192 and choice.type_k == "q8_0"
    cfg = PlanConfig(vram_bytes=4 * GiB, type_k="q8_0", type_v="q8_0")
    assert memory_at(info, 8192, choice.n_gpu_layers, cfg)["total"] <= 4 * GiB
    assert memory_at(info, 8192, choice.n_gpu_layers + 1, cfg)["total"] > 4 * GiB
    assert f"{choice.n_gpu_layers} layers on the GPU" in choice.note

    tiny = plan(load_settings(), info, 0.5)
    assert tiny.device == "cpu" and tiny.n_gpu_layers == 0


def test_explicit_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    info = catalog_info("llama-3.1-8b")
    choice = plan(load_settings(n_ctx=4096, type_k="q4_0", type_v="q4_0"), info, 6)
    assert (choice.n_ctx, choice.type_k, choice.type_v, choice.flash_attn) == (
        4096,
        "q4_0",
        "q4_0",
        True,
    )
    assert choice.sources["n_ctx"] == "flag" and choice.sources["flash_attn"] == "plan"
    assert "set by you: n_ctx, type_k, type_v" in choice.note

    monkeypatch.setenv("KVCHAT_FLASH_ATTN", "false")
    no_fa = plan(load_settings(), catalog_info("qwen2.5-1.5b"), 6)
    assert not no_fa.flash_attn and no_fa.type_k == "f16"
    assert no_fa.sources["flash_attn"] == "env KVCHAT_FLASH_ATTN"
    monkeypatch.delenv("KVCHAT_FLASH_ATTN")

    fixed = plan(load_settings(n_gpu_layers=20), info, 6)
    assert fixed.n_gpu_layers == 20 and fixed.sources["n_gpu_layers"] == "flag"
    assert fixed.device == "partial" and fixed.n_ctx > 0

    cpu = plan_defaults(load_settings(n_ctx=2048, flash_attn=True), budget=None)
    assert cpu.n_ctx == 2048 and cpu.flash_attn


def test_a_cpu_only_build_keeps_cpu_defaults_and_says_how_to_get_cuda() -> None:
    assert BUNDLED is not None
    choice = plan_defaults(load_settings(), info=read_gguf(BUNDLED), budget=gpu(6), offload=False)
    assert choice.device == "cpu" and not choice.flash_attn and choice.n_ctx == 8192
    assert "cannot offload" in choice.note and "GGML_CUDA=on" in choice.note


# --------------------------------------------------------------------------- the budget


def fake_nvml(
    monkeypatch: pytest.MonkeyPatch, *, free: int, total: int, fail: bool = False
) -> None:
    module = types.ModuleType("pynvml")

    def init() -> None:
        if fail:
            raise RuntimeError("NVML Shared Library Not Found")

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: object()  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(free=free, total=total)  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 3060 Laptop GPU"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_nvml_budget_then_vram_setting_then_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, free=5 * GiB, total=6 * GiB)
    budget = find_budget(load_settings())
    assert budget is not None and budget.source == "nvml" and budget.vram_bytes == 5 * GiB
    assert "RTX 3060" in budget.describe() and "(NVML)" in budget.describe()

    configured = find_budget(load_settings(vram="4GiB"))  # a set vram wins over NVML
    assert (
        configured is not None and configured.vram_bytes == 4 * GiB and configured.source == "flag"
    )
    assert find_budget(load_settings(detect_gpu=False)) is None

    fake_nvml(monkeypatch, free=5 * GiB, total=6 * GiB, fail=True)
    assert find_budget(load_settings()) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert find_budget(load_settings()) is None
    monkeypatch.setenv("KVCHAT_VRAM", "6GiB")
    env = find_budget(load_settings())
    assert env is not None and env.source == "env KVCHAT_VRAM"


def test_sources_name_flag_env_config_file_and_default(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text('temperature = 0.2\nvram = "8GiB"\n')
    monkeypatch.setenv("KVCHAT_TOP_P", "0.5")
    sources = load_settings(max_tokens=7).sources()
    assert sources["max_tokens"] == "flag"
    assert sources["top_p"] == "env KVCHAT_TOP_P"
    assert sources["temperature"].startswith("config file") and sources["vram"].startswith(
        "config file"
    )
    assert sources["n_ctx"] == "default"


# --------------------------------------------------------------------------- --model NAME|PATH


def test_model_by_catalog_name_path_or_bundled(home: Path) -> None:
    assert BUNDLED is not None
    for spec in (None, "bundled", "smollm2-135m", str(BUNDLED)):
        assert model_path(load_settings(model=spec)) == BUNDLED
    with pytest.raises(
        KvchatError, match=r"not downloaded: run `kvchat models pull qwen2\.5-1\.5b`"
    ):
        model_path(load_settings(model="qwen2.5-1.5b"))
    entry = find_entry("qwen2.5-1.5b", load_catalog())
    assert entry is not None
    models_dir().mkdir(parents=True)
    pulled = models_dir() / entry.file
    os.symlink(BUNDLED, pulled)  # a stand-in GGUF under the catalog file name
    assert model_path(load_settings(model="qwen2.5-1.5b")) == pulled
    assert model_path(load_settings(model=entry.file)) == pulled
    with pytest.raises(KvchatError, match="unknown model 'no-such-model'.*kvchat models list"):
        model_path(load_settings(model="no-such-model"))
    with pytest.raises(KvchatError, match="model file not found"):
        model_path(load_settings(model=str(home / "missing.gguf")))
