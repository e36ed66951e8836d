"""What a model costs on this machine's CPU: the RAM it takes at a context length, the RAM
free now, and the generation speed to expect.

Generating a token on a CPU reads every weight once, so its speed is bound by memory
bandwidth: tokens/s scale as 1 / weight bytes. The expectation is the engine probe's
measurement on this machine (:mod:`kvchat.engine.probe`: the fastest thread count, for the
model it measured) scaled by the weights' size; without a measurement there is none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvchat.planner.kv_bytes import fmt_bytes, kv_bytes_per_token
from kvchat.planner.model_info import ModelInfo
from kvchat.planner.plan import PlanConfig, compute_bytes, window_cells
from kvchat.system import current as current_system

# Besides weights, KV and compute: llama.cpp's own buffers, the tokenizer, Python.
RAM_OVERHEAD = 256 * 2**20


@dataclass(frozen=True)
class Measured:
    """A generation speed measured on this machine, and the model it was measured on."""

    tok_s: float
    model_bytes: int
    model_name: str


@dataclass(frozen=True)
class CpuFit:
    """The RAM ``n_ctx`` tokens take, the RAM free, and the tokens/s to expect (or None)."""

    n_ctx: int
    ram_needed: int
    ram_free: int | None
    tok_s: float | None
    measured: Measured | None

    @property
    def fits(self) -> bool | None:
        return None if self.ram_free is None else self.ram_needed <= self.ram_free

    def line(self) -> str:
        """E.g. "CPU: 8k context in ~1.2 GiB of RAM (18.3 GiB free), ~31 tok/s expected"."""
        ctx = f"{self.n_ctx // 1024}k" if self.n_ctx % 1024 == 0 else f"{self.n_ctx:,}"
        free = f" ({fmt_bytes(self.ram_free)} free)" if self.ram_free is not None else ""
        head = "CPU" if self.fits is not False else "too big for the RAM free"
        speed = f", ~{self.tok_s:.0f} tok/s expected" if self.tok_s else ""
        return f"{head}: {ctx} context in ~{fmt_bytes(self.ram_needed)} of RAM{free}{speed}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def available_ram() -> int | None:
    """The RAM the OS says is available for new work, in bytes (None where unknown)."""
    return current_system().available_ram()


def ram_needed(
    info: ModelInfo, n_ctx: int, type_k: str = "f16", type_v: str = "f16", swa_full: bool = False
) -> int:
    """Weights + the KV of ``n_ctx`` tokens (sliding-window layers: their window's cells,
    unless ``swa_full``) + recurrent layers' fixed state + the compute buffer + overhead,
    in bytes."""
    config = PlanConfig(vram_bytes=0, type_k=type_k, type_v=type_v, swa_full=swa_full)
    window = min(n_ctx, window_cells(info, n_ctx, config))
    kv = sum(
        size * (window if info.swa_layers[il] and not swa_full else n_ctx)
        for il, size in enumerate(kv_bytes_per_token(info, type_k, type_v).per_layer)
    )
    state = info.recurrent_layer_bytes * sum(info.recurrent_layers)
    compute = compute_bytes(info, n_ctx, config)["total"]
    return info.weight_bytes + kv + state + compute + RAM_OVERHEAD


def expected_tok_s(info: ModelInfo, measured: Measured | None) -> float | None:
    if measured is None or not measured.model_bytes or not info.weight_bytes:
        return None
    return measured.tok_s * measured.model_bytes / info.weight_bytes


def cpu_fit(
    info: ModelInfo, n_ctx: int, measured: Measured | None, type_k: str = "f16", type_v: str = "f16"
) -> CpuFit:
    return CpuFit(
        n_ctx=n_ctx,
        ram_needed=ram_needed(info, n_ctx, type_k, type_v),
        ram_free=available_ram(),
        tok_s=expected_tok_s(info, measured),
        measured=measured,
    )


__all__ = ["CpuFit", "Measured", "available_ram", "cpu_fit", "expected_tok_s", "ram_needed"]
