"""How much context fits in a VRAM budget: KV bytes per token, weights, compute buffer.

The model of llama.cpp's GPU memory (llama-cpp-python 0.3.36, one sequence):

- **KV cache.** Per token and per layer that keeps a cache:
  ``row(n_kv_heads × head_dim_k, type_k) + row(n_kv_heads × head_dim_v, type_v)`` where
  ``row(n, f16) = 2n``, ``row(n, q8_0) = 34 · n/32`` and ``row(n, q4_0) = 18 · n/32``.
  Full-attention layers hold ``n_ctx`` cells (llama.cpp pads n_ctx up to a multiple of 256).
  Sliding-window layers hold ``pad256(min(n_ctx, n_swa + n_ubatch))`` cells (llama.cpp's
  ``llama_kv_cache_iswa``, for kvchat's one sequence: kvchat opens these models without its
  scratch sequence, which would add another ``n_swa``), or ``n_ctx`` cells with ``swa_full``
  (kvchat's ``swa_full`` setting; off by default: window checkpoints at message boundaries
  let the context be cut back without the cells that left the window).
  A layer's cache lives on the same device as the layer.
- **Recurrent state.** A recurrent layer (Mamba 2, Gated DeltaNet, LFM2's short
  convolutions) keeps one fixed-size f32 state per sequence, whatever the context, on the
  layer's device: ``4 × recurrent_elements`` bytes (``model_info.recurrent_elements``).
- **Weights.** With ``n_gpu_layers = k`` llama.cpp puts the output layer and the last k-1
  repeating layers on the GPU (``i_gpu_start = n_layer + 1 - k``); k = n_layer + 1 (or -1)
  is full offload. The token embedding always stays in host RAM; a model with tied
  embeddings gets a second copy of it as the output matrix, on the output layer's device.
- **Compute buffer** (an estimate, not llama.cpp's own measure): the scratch of the graph for
  one micro-batch of ``n_ubatch`` tokens, whose big tensors are reused across layers::

      compute = max(logits, ffn, attention) + mask + dequant
      logits    = n_vocab · n_ubatch · 4          (only when the output layer is on the GPU)
      ffn       = 3 · n_ff · n_ubatch · 4         (gate, up and their product, f32)
      attention = n_kv · n_ubatch · n_head · 4    (the f32 KQ matrix; without flash attention)
                = 2 · n_head · head_dim · n_ubatch · 4   (with flash attention: no KQ matrix)
      mask      = n_kv · n_ubatch · 4
      dequant   = n_kv · (n_kv_heads·head_dim_k + n_kv_heads·head_dim_v) · 2
                  (flash attention with a quantized cache: the CUDA kernels convert K and V
                   to f16 for prompt processing)

  For Llama-3-8B at n_ctx 8192 with flash attention this gives 266 MiB; llama.cpp's CUDA
  backend reports about 258 MiB.
- **Reserve**: a fixed amount for the CUDA context, cuBLAS workspace, the desktop and
  fragmentation (default 512 MiB; ``--reserve``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvchat.errors import KvchatError

# kvchat.planner.kv_bytes's names are also read from here (the ``as`` marks a re-export).
from kvchat.planner.kv_bytes import (
    CELL_META_BYTES,
    KV_TYPES,
    GiB,
    KvPerToken,
    MiB,
    attention_summary,
    fmt_bytes,
    kv_bytes_per_token,
    row_bytes,
    state_bytes_per_token,
    state_window_bytes,
)
from kvchat.planner.kv_bytes import CLI_KV_TYPES as CLI_KV_TYPES
from kvchat.planner.kv_bytes import KiB as KiB
from kvchat.planner.kv_bytes import attention_of as attention_of
from kvchat.planner.kv_bytes import parse_size as parse_size
from kvchat.planner.model_info import ModelInfo

DEFAULT_VRAM = 6 * GiB
DEFAULT_RESERVE = 512 * MiB
DEFAULT_UBATCH = 512
CTX_STEP = 256  # llama.cpp pads n_ctx to a multiple of 256


def pad(n: int, step: int = CTX_STEP) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class PlanConfig:
    """The settings a plan is made for."""

    vram_bytes: int = DEFAULT_VRAM
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    swa_full: bool = False
    n_ubatch: int = DEFAULT_UBATCH
    reserve_bytes: int = DEFAULT_RESERVE

    def __post_init__(self) -> None:
        for kv_type in (self.type_k, self.type_v):
            if kv_type not in KV_TYPES:
                raise KvchatError(f"unknown KV cache type {kv_type!r}")
        if self.type_v not in ("f16", "f32", "bf16") and not self.flash_attn:
            raise KvchatError(f"a quantized V cache ({self.type_v}) needs flash attention")


def gpu_layers(info: ModelInfo, n_gpu_layers: int) -> tuple[list[bool], bool]:
    """(per repeating layer: on the GPU?, output layer on the GPU?) for ``n_gpu_layers``."""
    n = info.n_layer
    k = n + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n + 1)
    start = n + 1 - k
    return [il >= start for il in range(n)], k > 0 and n >= start


def compute_bytes(
    info: ModelInfo, n_ctx: int, cfg: PlanConfig, output_on_gpu: bool = True
) -> dict[str, int]:
    """The documented compute-buffer estimate (see the module docstring)."""
    ub = cfg.n_ubatch
    n_kv = pad(n_ctx)
    n_head = max(info.n_head) if info.n_head else 0
    logits = info.n_vocab * ub * 4 if output_on_gpu else 0
    ffn = 3 * info.n_ff * ub * 4
    if cfg.flash_attn:
        attention = 2 * n_head * max(info.head_dim_v, info.head_dim_v_swa) * ub * 4
    else:
        attention = n_kv * ub * n_head * 4
    mask = n_kv * ub * 4
    dequant = 0
    if cfg.flash_attn and (cfg.type_k not in ("f16", "bf16") or cfg.type_v not in ("f16", "bf16")):
        widest = max(
            (
                kv * (info.head_dims(il)[0] + info.head_dims(il)[1])
                for il, kv in enumerate(info.n_head_kv)
            ),
            default=0,
        )
        dequant = n_kv * widest * 2
    total = max(logits, ffn, attention) + mask + dequant
    return {
        "logits": logits,
        "ffn": ffn,
        "attention": attention,
        "mask": mask,
        "dequant": dequant,
        "total": total,
    }


def allocated_per_layer(info: ModelInfo, cfg: PlanConfig, kv: KvPerToken) -> tuple[int, ...]:
    """Bytes per cell llama.cpp allocates for each layer's cache: the KV rows, except that
    without flash attention (V stored transposed) a model whose layers' V widths differ
    gets every layer's V padded to the widest (llama.cpp's [TAG_V_CACHE_VARIABLE]), even a
    layer of width 0 (DeciLM's attention-free layers). Layers sharing another's cache
    (Gemma 3n) and, in a model with recurrent layers, the layers without attention heads
    (LFM2's convolutions, Nemotron-H's MLP-only layers) hold none."""
    hybrid = any(info.recurrent_layers)
    own = [
        il < info.n_layer - info.shared_kv_layers and not (hybrid and not info.n_head_kv[il])
        for il in range(info.n_layer)
    ]
    v_widths = [info.n_head_kv[il] * info.head_dims(il)[1] for il in range(info.n_layer)]
    variable = len({w for w, has in zip(v_widths, own) if has}) > 1
    if cfg.flash_attn or not variable:
        return kv.per_layer
    widest = max(v_widths)
    sizes = []
    for il in range(info.n_layer):
        k_width = info.n_head_kv[il] * info.head_dims(il)[0]
        has = own[il]
        sizes.append(row_bytes(k_width, cfg.type_k) + row_bytes(widest, cfg.type_v) if has else 0)
    return tuple(sizes)


def window_cells(info: ModelInfo, n_ctx: int, cfg: PlanConfig) -> int:
    """Cells llama.cpp gives each sliding-window layer without swa_full (``n_ctx`` cells
    when the model has no window)."""
    if not info.sliding_window:
        return pad(n_ctx)
    return pad(min(pad(n_ctx), info.sliding_window + cfg.n_ubatch))


def memory_at(
    info: ModelInfo, n_ctx: int, n_gpu_layers: int, cfg: PlanConfig, kv: KvPerToken | None = None
) -> dict[str, int]:
    """VRAM and host-RAM bytes for ``n_ctx`` tokens with ``n_gpu_layers`` offloaded."""
    kv = kv or kv_bytes_per_token(info, cfg.type_k, cfg.type_v)
    per_layer = allocated_per_layer(info, cfg, kv)
    on_gpu, out_gpu = gpu_layers(info, n_gpu_layers)
    full_cells = pad(n_ctx)
    swa_cells = full_cells if cfg.swa_full else window_cells(info, n_ctx, cfg)
    gpu_w = host_w = gpu_kv = host_kv = gpu_rec = host_rec = 0
    recurrent = info.recurrent_layers or (False,) * info.n_layer
    for il in range(info.n_layer):
        cells = swa_cells if info.swa_layers[il] else full_cells
        layer_kv = per_layer[il] * cells
        state = info.recurrent_layer_bytes if recurrent[il] else 0
        if on_gpu[il]:
            gpu_w += info.layer_bytes[il]
            gpu_kv += layer_kv
            gpu_rec += state
        else:
            host_w += info.layer_bytes[il]
            host_kv += layer_kv
            host_rec += state
    if out_gpu:
        gpu_w += info.output_bytes
    else:
        host_w += info.output_bytes
    host_w += info.input_bytes
    any_gpu = any(on_gpu) or out_gpu
    compute = compute_bytes(info, n_ctx, cfg, out_gpu)["total"] if any_gpu else 0
    reserve = cfg.reserve_bytes if any_gpu else 0
    return {
        "n_ctx": full_cells,
        "weights": gpu_w,
        "kv": gpu_kv,
        "recurrent": gpu_rec,
        "compute": compute,
        "reserve": reserve,
        "total": gpu_w + gpu_kv + gpu_rec + compute + reserve,
        "host_weights": host_w,
        "host_kv": host_kv,
        "host_recurrent": host_rec,
    }


def max_context(
    info: ModelInfo,
    n_gpu_layers: int,
    cfg: PlanConfig,
    limit: int | None = None,
    kv: KvPerToken | None = None,
) -> int:
    """Largest n_ctx (a multiple of 256, ≤ ``limit``) whose VRAM total fits; 0 if none."""
    limit = limit or info.context_length or 131072
    kv = kv or kv_bytes_per_token(info, cfg.type_k, cfg.type_v)

    def fits(steps: int) -> bool:
        return memory_at(info, steps * CTX_STEP, n_gpu_layers, cfg, kv)["total"] <= cfg.vram_bytes

    lo, hi = 0, limit // CTX_STEP
    if hi == 0 or not fits(1):
        return 0
    while lo < hi:  # largest fitting step count; memory grows with n_ctx
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


# The context the window figures are compared at (the README's "hot KV at 32k").
COMPARE_CTX = 32768


def window_figures(info: ModelInfo, cfg: PlanConfig, kv: KvPerToken) -> dict[str, int] | None:
    """A sliding-window model's KV with window-sized caches and with ``swa_full``, at
    :data:`COMPARE_CTX` (or the trained context, if shorter), and the context each fits
    at full offload in the budget; None for a model without sliding-window layers."""
    if not (info.sliding_window and any(info.swa_layers)):
        return None
    limit = info.context_length or 131072
    at = min(COMPARE_CTX, limit)
    windows, every = (replace(cfg, swa_full=full) for full in (False, True))
    full_ngl = info.n_layer + 1

    def kv_at(config: PlanConfig) -> int:
        mem = memory_at(info, at, full_ngl, config, kv)
        return mem["kv"] + mem["host_kv"]

    return {
        "n_ctx": at,
        "window_cells": window_cells(info, at, windows),
        "kv_windows": kv_at(windows),
        "kv_swa_full": kv_at(every),
        "max_ctx_windows": max_context(info, full_ngl, windows, limit, kv),
        "max_ctx_swa_full": max_context(info, full_ngl, every, limit, kv),
    }


@dataclass
class OffloadRow:
    """What fits with one n_gpu_layers setting."""

    n_gpu_layers: int
    gpu_layers: int  # repeating layers on the GPU
    output_on_gpu: bool
    gpu_weight_bytes: int
    max_ctx: int
    memory: dict[str, int]  # breakdown at max_ctx (or at 256 tokens when nothing fits)


@dataclass
class Plan:
    """A model's memory plan for one budget and KV type."""

    info: ModelInfo
    config: PlanConfig
    kv: KvPerToken
    full: OffloadRow
    partial: list[OffloadRow]
    target_ctx: int
    best_split: OffloadRow | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``kv_bytes_per_token`` is the all-layers per-token figure."""
        return {
            "model": self.info.to_dict(),
            "config": asdict(self.config),
            "attention": attention_summary(self.info),
            "state_bytes_per_token": state_bytes_per_token(self.info, self.kv),
            "state_window_bytes": state_window_bytes(self.info, self.kv),
            "kv_bytes_per_token": self.kv.total,
            "kv_bytes_per_token_by_kind": {
                "full_attention": self.kv.full,
                "sliding_window": self.kv.swa,
            },
            "kv_bytes_per_token_per_layer": list(self.kv.per_layer),
            "sliding_windows": window_figures(self.info, self.config, self.kv),
            "recurrent_state_bytes": self.info.recurrent_state_bytes,
            "weight_bytes": self.info.weight_bytes,
            "gpu_weight_bytes_full_offload": self.full.gpu_weight_bytes,
            "compute_buffer_estimate": compute_bytes(
                self.info, max(self.full.max_ctx, 1), self.config
            ),
            "full_offload": asdict(self.full),
            "partial_offload": [asdict(row) for row in self.partial],
            "target_ctx": self.target_ctx,
            "best_split": asdict(self.best_split) if self.best_split else None,
            "notes": self.notes,
        }


def _row(info: ModelInfo, ngl: int, cfg: PlanConfig, kv: KvPerToken, limit: int) -> OffloadRow:
    ctx = max_context(info, ngl, cfg, limit, kv)
    mem = memory_at(info, ctx or CTX_STEP, ngl, cfg, kv)
    on_gpu, out_gpu = gpu_layers(info, ngl)
    return OffloadRow(
        n_gpu_layers=ngl,
        gpu_layers=sum(on_gpu),
        output_on_gpu=out_gpu,
        gpu_weight_bytes=mem["weights"],
        max_ctx=ctx,
        memory=mem,
    )


def make_plan(
    info: ModelInfo, cfg: PlanConfig | None = None, target_ctx: int | None = None
) -> Plan:
    """Full offload, a few partial-offload splits, and the best split for ``target_ctx``."""
    cfg = cfg or PlanConfig()
    kv = kv_bytes_per_token(info, cfg.type_k, cfg.type_v)
    limit = info.context_length or 131072
    target = min(target_ctx or limit, limit)
    n = info.n_layer
    full = _row(info, n + 1, cfg, kv, limit)
    partial_ngls = sorted({n, (3 * n) // 4, n // 2, n // 4} - {0}, reverse=True)
    partial = [_row(info, k, cfg, kv, limit) for k in partial_ngls]
    best: OffloadRow | None = None
    for k in range(n + 1, 0, -1):
        if memory_at(info, target, k, cfg, kv)["total"] <= cfg.vram_bytes:
            best = _row(info, k, cfg, kv, limit)
            best.memory = memory_at(info, target, k, cfg, kv)
            break
    notes = list(info.notes)
    if info.sliding_window and any(info.swa_layers) and cfg.swa_full:
        notes.append(
            f"sliding-window layers keep every token (swa_full = true); with swa_full "
            f"off (the default) they keep {window_cells(info, limit, cfg):,} cells"
        )
    if info.attention_kind == "MHA":
        notes.append(
            "multi-head attention (one KV head per query head): the KV cache is "
            "large per token; a GQA model of the same size fits far more context"
        )
    return Plan(
        info=info,
        config=cfg,
        kv=kv,
        full=full,
        partial=partial,
        target_ctx=target,
        best_split=best,
        notes=notes,
    )


# --------------------------------------------------------------------------- text


def fmt_ctx(row: OffloadRow, limit: int) -> str:
    if row.max_ctx == 0:
        return "does not fit"
    suffix = " (trained limit)" if row.max_ctx >= (limit // CTX_STEP) * CTX_STEP else ""
    return f"{row.max_ctx:,}{suffix}"


def model_lines(info: ModelInfo) -> list[str]:
    """The plan's lines for a thinking model and for a hybrid (none for the others)."""
    lines = []
    if info.thinking:
        switch = (
            f"the chat template's {info.thinking_switch} turns it off"
            if info.thinking_switch
            else "it has no switch"
        )
        lines.append(f"thinking model: it writes its reasoning before the answer ({switch})")
    if info.hybrid:
        attends = sum(1 for kv in info.n_head_kv if kv)
        lines.append(
            f"hybrid: attention on {attends} of {info.n_layer} layers (only they keep KV per "
            f"token); {sum(info.recurrent_layers)} recurrent layers keep "
            f"{info.recurrent_layer_bytes:,} bytes each, whatever the context"
        )
    return lines


def format_plan(plan: Plan) -> str:
    """The human-readable plan printed by ``kvchat models plan``."""
    info, cfg, kv = plan.info, plan.config, plan.kv
    limit = info.context_length or 131072
    trained = f"{info.context_length:,}" if info.context_length else "unknown (planned to 131,072)"
    kinds = {kv_h for kv_h in info.n_head_kv if kv_h}
    kv_heads = "/".join(str(k) for k in sorted(kinds)) or "0"
    heads = "/".join(str(h) for h in sorted(set(info.n_head)))
    where = info.path if info.source == "gguf" else "catalog figures (file not downloaded)"
    lines = [
        f"{info.name}: {info.architecture}, {info.n_layer} layers, {heads} heads, "
        f"{kv_heads} KV heads ({info.attention_kind}), head dim {info.head_dim_k}/"
        f"{info.head_dim_v}, trained context {trained}",
        f"  from: {where}",
        *model_lines(info),
        f"weights: {fmt_bytes(info.weight_bytes)} ({info.quantization or '?'}); on the GPU at "
        f"full offload: {fmt_bytes(plan.full.gpu_weight_bytes)}",
        f"KV cache ({cfg.type_k} K, {cfg.type_v} V): {kv.total:,} bytes/token "
        f"({fmt_bytes(kv.total)})",
    ]
    n_full = sum(1 for il in range(info.n_layer) if not info.swa_layers[il] and info.n_head_kv[il])
    n_swa = sum(1 for il in range(info.n_layer) if info.swa_layers[il] and info.n_head_kv[il])
    lines.append(f"  full-attention layers: {n_full}, {kv.full:,} bytes/token")
    if n_swa:
        lines.append(
            f"  sliding-window layers: {n_swa} (window {info.sliding_window:,}), "
            f"{kv.swa:,} bytes/token"
        )
    figures = window_figures(info, cfg, kv)
    if figures:
        used = "windows" if not cfg.swa_full else "swa_full"
        lines.append(
            f"  sliding-window layers keep {figures['window_cells']:,} cells (window "
            f"{info.sliding_window:,} + n_ubatch {cfg.n_ubatch}, padded to 256) unless "
            f"swa_full; planned with {used}"
        )
        lines.append(
            f"  KV at {figures['n_ctx']:,} tokens: {fmt_bytes(figures['kv_windows'])} with "
            f"windows, {fmt_bytes(figures['kv_swa_full'])} with swa_full; full offload fits "
            f"{figures['max_ctx_windows']:,} tokens with windows, "
            f"{figures['max_ctx_swa_full']:,} with swa_full"
        )
    growth = state_bytes_per_token(info, kv)
    window = state_window_bytes(info, kv)
    if info.recurrent_state_bytes:
        layers = sum(info.recurrent_layers)
        lines.append(
            f"recurrent layers: {layers}, a fixed state of {info.recurrent_state_bytes:,} bytes "
            f"per sequence whatever the context (snapshots store it whole: it holds the last "
            f"position only)"
        )
    if window:
        lines.append(
            f"snapshot (llama.cpp's seq state): {growth:,} bytes/token (full-attention "
            f"layers + {CELL_META_BYTES} B cell metadata) + the window, "
            f"{fmt_bytes(window)} ({info.sliding_window:,} cells × "
            f"{kv.swa + CELL_META_BYTES:,} B) once full; chunked, with a window "
            "checkpoint at each message boundary"
        )
    else:
        lines.append(
            f"snapshot (llama.cpp's seq state): {growth:,} bytes/token (KV + "
            f"{CELL_META_BYTES} B cell metadata), chunked"
        )
    comp = compute_bytes(info, max(plan.full.max_ctx, CTX_STEP), cfg)
    lines += [
        f"budget: {fmt_bytes(cfg.vram_bytes)} VRAM, of which {fmt_bytes(cfg.reserve_bytes)} "
        f"reserved (CUDA context, desktop); compute buffer estimate "
        f"{fmt_bytes(comp['total'])} (flash attention {'on' if cfg.flash_attn else 'off'}, "
        f"n_ubatch {cfg.n_ubatch})",
        "",
        f"full offload (n_gpu_layers={plan.full.n_gpu_layers}): max context "
        f"{fmt_ctx(plan.full, limit)}",
    ]
    mem = plan.full.memory
    if plan.full.max_ctx:
        state = f" + recurrent state {fmt_bytes(mem['recurrent'])}" if mem["recurrent"] else ""
        lines.append(
            f"  VRAM then: weights {fmt_bytes(mem['weights'])} + KV "
            f"{fmt_bytes(mem['kv'])}{state} + compute {fmt_bytes(mem['compute'])} + reserve "
            f"{fmt_bytes(mem['reserve'])} = {fmt_bytes(mem['total'])}"
        )
    lines.append("partial offload (the rest of the layers and their KV stay in host RAM):")
    lines.append(f"  {'n_gpu_layers':>12}  {'weights on GPU':>14}  max context")
    for row in plan.partial:
        lines.append(
            f"  {row.n_gpu_layers:>12}  {fmt_bytes(row.gpu_weight_bytes):>14}  "
            f"{fmt_ctx(row, limit)}"
        )
    if plan.best_split:
        b = plan.best_split
        lines.append(
            f"best split for {plan.target_ctx:,} tokens: n_gpu_layers={b.n_gpu_layers} "
            f"(VRAM {fmt_bytes(b.memory['total'])}, host RAM "
            f"{fmt_bytes(b.memory['host_weights'] + b.memory['host_kv'])})"
        )
    else:
        lines.append(f"{plan.target_ctx:,} tokens do not fit even with one layer on the GPU")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
