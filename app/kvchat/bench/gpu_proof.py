"""The GPU proof's decisions (``scripts/gpu_proof.py`` runs them on a machine with an NVIDIA
GPU): whether the proof can run, which cases of the exactness matrix it runs, what NVML
says is in use, and whether a plan held. Everything here takes NVML as a value (pynvml, or
a fake in tests), so the decisions are tested where there is no GPU.

The report (one JSON object, ``SCHEMA``):

* ``schema``: 1; ``ran``: whether the proof ran; ``reason``: why not (null when it ran);
* ``gpu``: ``{name, total_bytes, used_bytes, free_bytes}`` from NVML before anything loads;
* ``exactness``: per case ``{type_k, type_v, flash_attn, run, skip_reason, tokens,
  state_hash_equal, greedy_equal, decoded_resume, decoded_prefill}``;
* ``plans``: per model ``{model, planned_bytes, measured_bytes, over_plan, held}``
  (measured = NVML's used memory with the model loaded less before it);
* ``six_gb``: ``{run, skip_reason, n_ctx, type_k, type_v, planned_bytes, measured_bytes,
  held}``: a plan for a 6 GiB card made on a larger one;
* ``peers``: ``kvchat bench --peers --json``'s object run on the GPU, or ``{"error": …}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

SCHEMA = 1
GIB = 1 << 30
SIX_GB = 6 * GIB
# A plan holds when what NVML measures is at most this much over it (CUDA's own context,
# cuBLAS workspaces and allocator rounding are not in the plan).
PLAN_SLACK = 0.15
PLAN_SLACK_BYTES = 512 << 20
KV_TYPES = ("f16", "q8_0", "q4_0")


class Nvml(Protocol):
    """The part of pynvml the proof uses."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> Any: ...


@dataclass(frozen=True)
class GpuReading:
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_gpu(nvml: Nvml | None) -> GpuReading | str:
    """GPU 0's memory as NVML reports it, or one line saying why there is no reading."""
    if nvml is None:
        return "no NVML (pip install nvidia-ml-py on the GPU machine)"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml raises its own NVMLError subclasses
        return f"NVML did not start: {exc}"
    try:
        if int(nvml.nvmlDeviceGetCount()) < 1:
            return "NVML sees no GPU"
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", errors="replace")
        total, used, free = int(memory.total), int(memory.used), int(memory.free)
    except Exception as exc:
        return f"NVML could not read GPU 0: {exc}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    if total <= 0 or used < 0 or free < 0 or used > total:
        return f"NVML reported impossible memory figures (total {total}, used {used})"
    return GpuReading(" ".join(str(name).split())[:80], total, used, free)


def preflight(reading: GpuReading | str, offload_supported: bool) -> str | None:
    """Why the proof cannot run here (None: it can)."""
    if isinstance(reading, str):
        return reading
    if not offload_supported:
        return (
            "this llama-cpp-python is not a GPU build (llama_supports_gpu_offload() is false): "
            'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall llama-cpp-python'
        )
    return None


@dataclass(frozen=True)
class Case:
    type_k: str
    type_v: str
    flash_attn: bool
    skip_reason: str | None = None

    @property
    def run(self) -> bool:
        return self.skip_reason is None


def exactness_cases() -> list[Case]:
    """KV f16, q8_0, q4_0 × flash attention on and off. A quantized V cache needs flash
    attention (llama.cpp refuses it otherwise): those cases are listed, not run."""
    cases = []
    for kv in KV_TYPES:
        for flash_attn in (True, False):
            skip = None
            if kv != "f16" and not flash_attn:
                skip = f"a quantized V cache ({kv}) needs flash attention"
            cases.append(Case(kv, kv, flash_attn, skip))
    return cases


@dataclass(frozen=True)
class PlanCheck:
    model: str
    planned_bytes: int
    measured_bytes: int

    @property
    def over_plan(self) -> float:
        return self.measured_bytes / self.planned_bytes if self.planned_bytes else 0.0

    @property
    def held(self) -> bool:
        """Measured within the plan and its slack."""
        allowed = self.planned_bytes * (1 + PLAN_SLACK) + PLAN_SLACK_BYTES
        return 0 < self.measured_bytes <= allowed

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "over_plan": round(self.over_plan, 3), "held": self.held}


def measured_use(before: GpuReading, after: GpuReading) -> int:
    """Bytes the loaded model and context took: NVML's used memory after less before."""
    return max(0, after.used_bytes - before.used_bytes)


def six_gb_case(reading: GpuReading) -> str | None:
    """Why a 6 GiB plan is not tried on this card (None: it is)."""
    if reading.total_bytes <= SIX_GB:
        return "the card itself has 6 GiB or less: its own plan is the 6 GiB proof"
    if reading.free_bytes < SIX_GB:
        return f"only {reading.free_bytes / GIB:.1f} GiB free: a 6 GiB plan cannot be measured"
    return None


def six_gb_held(measured_bytes: int) -> bool:
    """A plan for 6 GiB held when what NVML measured fits in 6 GiB."""
    return 0 < measured_bytes <= SIX_GB


def report_skeleton(reading: GpuReading | str, reason: str | None) -> dict[str, Any]:
    """The report before any measurement: what ran, and why not."""
    return {
        "schema": SCHEMA,
        "ran": reason is None,
        "reason": reason,
        "gpu": reading.to_json() if isinstance(reading, GpuReading) else None,
        "exactness": [
            {
                "type_k": c.type_k,
                "type_v": c.type_v,
                "flash_attn": c.flash_attn,
                "run": c.run and reason is None,
                "skip_reason": c.skip_reason or reason,
            }
            for c in exactness_cases()
        ],
        "plans": [],
        "six_gb": {"run": False, "skip_reason": reason},
        "peers": None,
    }
