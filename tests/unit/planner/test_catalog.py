"""The model catalog (``models/catalog.toml``): every entry's planner row checked against an
arithmetic written again here from the entry's own figures, the thinking and hybrid keys,
and the marks ``kvchat models list|plan`` and the F9 picker show for them.

The independent arithmetic follows models/README.md, not the planner's code: KV rows per
attending layer, window-sized cells for sliding-window layers, a fixed f32 state for each
recurrent layer, the compute estimate and the catalog's weight estimate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from textual.app import App
from textual.widgets import OptionList

from kvchat.cli.model_commands import models_group
from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.planner import PlanConfig, info_from_catalog, kv_bytes_per_token, load_catalog
from kvchat.planner.catalog import CatalogEntry
from kvchat.planner.plan import GiB, MiB, max_context, memory_at
from kvchat.service.chat import ChatService
from kvchat.tui.screens.model_picker import ModelScreen, choice_content

CATALOG = load_catalog()
VRAM = 6 * GiB
UBATCH = 512
# Bits per weight of a Q4_K_M token embedding and of a Q6_K output matrix (README).
EMBD_BITS = {"Q4_K_M": 4.5, "Q4_1": 5.0}
OUTPUT_BITS = 6.5625
ROW = {"f16": lambda n: 2 * n, "q8_0": lambda n: 34 * n // 32, "q4_0": lambda n: 18 * n // 32}

THINKING = {"qwen3-4b", "qwen3-8b", "qwen3.5-4b", "smollm3-3b"}
HYBRIDS = {"qwen3.5-4b", "granite-4.0-h-micro", "granite-4.0-h-tiny", "lfm2-1.2b", "lfm2-2.6b"}


def pad(n: int) -> int:
    return -(-n // 256) * 256


def attending(entry: CatalogEntry) -> list[int]:
    return list(entry.attention_layers) or list(range(entry.layers))


def sliding(entry: CatalogEntry, layer: int) -> bool:
    """llama.cpp's pattern: in each group of ``period`` layers all but the last slide."""
    period = entry.sliding_window_pattern
    return bool(entry.sliding_window and period) and layer % period < period - 1


def kv_row(entry: CatalogEntry, kv_type: str) -> int:
    """One attending layer's K and V rows for one token."""
    return 2 * ROW[kv_type](entry.kv_heads * entry.head_dim)


def state_elements(entry: CatalogEntry) -> int:
    if entry.recurrent == "shortconv":
        return entry.embedding_length * (entry.conv_l_cache - 1)
    conv = (entry.ssm_conv_kernel - 1) * (
        entry.ssm_inner_size + 2 * entry.ssm_group_count * entry.ssm_state_size
    )
    return conv + entry.ssm_state_size * entry.ssm_inner_size


def gpu_weights(entry: CatalogEntry) -> int:
    """The catalog's estimate at full offload: the repeating layers and the output matrix
    (a Q6_K copy of the embedding when tied); the token embedding stays in host RAM."""
    elements = entry.vocab_size * entry.embedding_length
    output = int(elements * OUTPUT_BITS / 8)
    embedding = (
        output if entry.tied_embeddings else int(elements * EMBD_BITS[entry.quantization] / 8)
    )
    body = entry.size_bytes - embedding - (0 if entry.tied_embeddings else output)
    return body // entry.layers * entry.layers + output


def vram_at(entry: CatalogEntry, n_ctx: int, kv_type: str) -> int:
    """Full offload, flash attention, window-sized sliding-window caches, 512 MiB reserve."""
    cells = pad(n_ctx)
    window = pad(min(cells, entry.sliding_window + UBATCH)) if entry.sliding_window else cells
    kv = sum(
        kv_row(entry, kv_type) * (window if sliding(entry, il) else cells)
        for il in attending(entry)
    )
    recurrent = (
        (entry.layers - len(attending(entry))) * 4 * state_elements(entry) if entry.hybrid else 0
    )
    compute = (
        max(
            entry.vocab_size * UBATCH * 4,
            3 * entry.feed_forward_length * UBATCH * 4,
            2 * entry.heads * entry.head_dim * UBATCH * 4,
        )
        + cells * UBATCH * 4
    )
    if kv_type != "f16":  # quantized K/V converted to f16 for prompt processing
        compute += cells * 2 * entry.kv_heads * entry.head_dim * 2
    return gpu_weights(entry) + kv + recurrent + compute + 512 * MiB


@pytest.mark.parametrize("entry", CATALOG, ids=[e.name for e in CATALOG])
def test_every_entry_plans_from_its_own_figures(entry: CatalogEntry) -> None:
    info = info_from_catalog(entry)
    layers = attending(entry)
    for kv_type in ("f16", "q8_0", "q4_0"):
        kv = kv_bytes_per_token(info, kv_type)
        assert kv.total == len(layers) * kv_row(entry, kv_type), (entry.name, kv_type)
        swa = sum(1 for il in layers if sliding(entry, il))
        assert kv.swa == swa * kv_row(entry, kv_type)
    if entry.hybrid:
        recurrent = entry.layers - len(layers)
        assert sum(info.recurrent_layers) == recurrent > 0
        assert info.recurrent_state_bytes == 28 + recurrent * (24 + 4 * state_elements(entry))
    else:
        assert info.recurrent_state_bytes == 0
    # The fit: the largest context the planner finds is within 6 GiB by this arithmetic,
    # 256 tokens more is not (unless it is the trained context), and both agree byte for byte.
    limit = entry.context_length // 256 * 256
    for kv_type in ("f16", "q8_0", "q4_0"):
        cfg = PlanConfig(type_k=kv_type, type_v=kv_type)
        ctx = max_context(info, -1, cfg)
        assert ctx > 0, (entry.name, kv_type)
        assert memory_at(info, ctx, -1, cfg)["total"] == vram_at(entry, ctx, kv_type)
        assert vram_at(entry, ctx, kv_type) <= VRAM
        assert ctx == limit or vram_at(entry, ctx + 256, kv_type) > VRAM, (entry.name, kv_type)


def test_the_refreshed_catalog_keeps_the_bundled_model_first_and_marks_its_kinds() -> None:
    names = [e.name for e in CATALOG]
    assert names[0] == "smollm2-135m"
    bundled = CATALOG[0].to_dict()
    assert {k: bundled[k] for k in ("file", "size_bytes", "layers", "kv_heads", "bundled")} == {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "size_bytes": 98_362_432,
        "layers": 30,
        "kv_heads": 3,
        "bundled": True,
    }
    wanted = THINKING | HYBRIDS | {"gemma-3-4b", "phi-4-mini", "llama-3.1-8b"}
    assert wanted <= set(names)
    assert {e.name for e in CATALOG if e.thinking} == THINKING
    assert {e.name for e in CATALOG if e.hybrid} == HYBRIDS
    assert {e.thinking_switch for e in CATALOG if e.thinking} == {"enable_thinking"}
    gemma3 = next(e for e in CATALOG if e.name == "gemma-3-4b")
    assert (gemma3.sliding_window, sum(info_from_catalog(gemma3).swa_layers)) == (1024, 29)
    granite = info_from_catalog(next(e for e in CATALOG if e.name == "granite-4.0-h-micro"))
    assert [il for il, kv in enumerate(granite.n_head_kv) if kv] == [5, 15, 25, 35]


def write_catalog(tmp_path: Path, extra: str) -> Path:
    base = (Path(__file__).parents[3] / "models" / "catalog.toml").read_text(encoding="utf-8")
    first = base.index("[[model]]", base.index("[[model]]") + 1)  # the bundled entry only
    path = tmp_path / "catalog.toml"
    path.write_text(base[:first] + extra, encoding="utf-8")
    return path


HYBRID_ROW = """
[[model]]
name = "x"
title = "x"
source_model = "x/x"
hf_repo = "x/x-GGUF"
file = "x.gguf"
quantization = "Q4_K_M"
size_bytes = 1_000_000
architecture = "lfm2"
layers = 4
heads = 4
kv_heads = 2
head_dim = 8
embedding_length = 32
feed_forward_length = 64
vocab_size = 100
tied_embeddings = true
context_length = 4096
attention = "GQA"
license = "x"
"""


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ('attention_layers = [1]\nrecurrent = "shortconv"\n', "without conv_l_cache"),
        ('attention_layers = [4]\nrecurrent = "shortconv"\nconv_l_cache = 3\n', "below 4"),
        ('attention_layers = [2, 1]\nrecurrent = "shortconv"\nconv_l_cache = 3\n', "ascending"),
        ("attention_layers = [1]\nconv_l_cache = 3\n", "recurrent kind is not one of"),
        ('recurrent = "mamba2"\n', "without attention_layers"),
        ('thinking_switch = "enable_thinking"\n', "not a thinking model"),
        ('thinking = true\nthinking_switch = "/no_think"\n', "unknown thinking_switch"),
    ],
)
def test_hybrid_and_thinking_keys_that_do_not_hold_together_are_refused(
    tmp_path: Path, keys: str, problem: str
) -> None:
    with pytest.raises(KvchatError, match=problem) as caught:
        load_catalog(write_catalog(tmp_path, HYBRID_ROW + keys))
    assert "model 'x'" in str(caught.value)


def test_a_valid_hybrid_row_loads(tmp_path: Path) -> None:
    keys = 'attention_layers = [1, 3]\nrecurrent = "shortconv"\nconv_l_cache = 3\n'
    entry = load_catalog(write_catalog(tmp_path, HYBRID_ROW + keys))[1]
    info = info_from_catalog(entry)
    assert info.n_head_kv == (0, 2, 0, 2) and info.recurrent_layers == (True, False, True, False)
    assert info.recurrent_layer_bytes == 4 * 32 * 2


def invoke(*args: str) -> Any:
    return CliRunner().invoke(models_group, list(args), catch_exceptions=False)


def test_models_list_and_plan_show_thinking_and_hybrid(kvhome: Path) -> None:
    rows = {row["name"]: row for row in json.loads(invoke("list", "--json").output)["models"]}
    assert rows["qwen3.5-4b"]["marks"] == ["thinking", "hybrid"]
    assert rows["qwen3.5-4b"]["attention_layers"] == 8
    assert rows["qwen3-4b"]["marks"] == ["thinking"] and rows["qwen3-4b"]["hybrid"] is False
    assert rows["gemma-3-4b"]["marks"] == [] and rows["lfm2-1.2b"]["marks"] == ["hybrid"]
    lines = {line.split()[0]: line for line in invoke("list").output.splitlines() if line}
    assert lines["qwen3.5-4b"].endswith("thinking, hybrid")
    assert lines["granite-4.0-h-tiny"].endswith("hybrid")
    assert lines["llama-3.1-8b"].endswith("llama3.1")
    text = invoke("plan", "granite-4.0-h-micro").output
    assert "hybrid: attention on 4 of 40 layers" in text
    assert "36 recurrent layers keep 2,149,376 bytes each" in text
    assert "+ recurrent state 73.79 MiB +" in text  # 36 × 2,149,376 bytes in the VRAM sum
    text = invoke("plan", "qwen3-8b").output
    assert "thinking model: it writes its reasoning before the answer (the chat template's " in text
    assert "hybrid:" not in text


async def test_the_picker_shows_the_marks(kvhome: Path) -> None:
    service = ChatService(Settings(n_threads=1))  # type: ignore[call-arg]
    try:
        choices = service.models.model_choices()
    finally:
        service.close()
    by_name = {c.name: c for c in choices}
    assert by_name["qwen3.5-4b"].marks == ("thinking", "hybrid")
    assert by_name["granite-4.0-h-micro"].marks == ("hybrid",)
    assert by_name["gemma-3-4b"].marks == ()
    assert choice_content(by_name["qwen3-4b"]).plain.split("\n")[0].endswith("· catalog · thinking")

    class Picker(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ModelScreen(choices))

    app = Picker()
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.pause()
        options = app.screen.query_one("#model-list", OptionList)
        shown = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert sum("thinking · hybrid" in line for line in shown) == 1  # Qwen3.5 4B
        assert sum(line.split("\n")[0].endswith("· hybrid") for line in shown) == len(HYBRIDS)
