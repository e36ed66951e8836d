"""Context settings chosen from the memory plan for the GPU this machine has.

kvchat picks ``n_ctx``, ``type_k``/``type_v``, ``flash_attn`` and ``n_gpu_layers`` itself:

1. **The budget.** A ``vram`` setting (config, ``KVCHAT_VRAM`` or a flag) wins; else NVML
   (the ``nvidia-ml-py`` package, imported lazily: it is not a dependency) reports the free
   memory of GPU 0; else there is no GPU budget and the CPU defaults stay: ``n_ctx`` 8192,
   f16 KV, flash attention off (much slower on a small CPU). A GPU budget is used only
   when this llama-cpp-python build can offload (a CPU-only build gets the CPU defaults and
   a warning naming the CUDA install line).
2. **The plan** (``kvchat.planner.plan``, from the GGUF metadata; the model is not loaded):
   flash attention on; the target context is the model's trained context, capped at
   :data:`AUTO_CTX_CAP`; the KV type is the first of f16, q8_0 that lets the whole model
   and that context fit on the GPU, else q8_0 when it still reaches :data:`GOOD_CTX`
   tokens, else q4_0; when even that leaves less than :data:`MIN_CTX` tokens, the largest
   ``n_gpu_layers`` that holds :data:`PARTIAL_CTX` tokens (partial offload), else the CPU.
3. **Explicit values win.** Every field the user set (``Settings.model_fields_set``: flag,
   environment or config file) is kept as given and the plan works around it: a set
   ``n_ctx`` becomes the target, set KV types or flash attention are the only candidates,
   a set ``n_gpu_layers`` fixes the split.

:func:`plan_defaults` returns a :class:`DefaultsChoice` with the values, where each came
from and a one-line note for the UI; ``ChatService.load_engine`` applies it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.planner.plan import (
    CTX_STEP,
    PlanConfig,
    fmt_bytes,
    max_context,
    memory_at,
    parse_size,
)

if TYPE_CHECKING:
    from kvchat.config import Settings
    from kvchat.planner.model_info import ModelInfo

PLANNED_FIELDS = ("n_ctx", "type_k", "type_v", "flash_attn", "n_gpu_layers")
# Longest context picked on its own: a bigger one costs VRAM the user may want elsewhere and
# a longer prefill when a conversation is re-read; set n_ctx to go further.
AUTO_CTX_CAP = 32768
# A quantized-to-4-bit cache is chosen only when q8_0 leaves less than this.
GOOD_CTX = 8192
# Full offload with less context than this is not worth it: offload fewer layers instead.
MIN_CTX = 4096
# The context a partial offload is sized for.
PARTIAL_CTX = 8192
CUDA_INSTALL = (
    'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'
)


@dataclass(frozen=True)
class GpuBudget:
    """The GPU memory a plan may use, and where that figure came from."""

    source: str  # "nvml" or the settings source of ``vram`` ("flag", "env KVCHAT_VRAM", ...)
    vram_bytes: int
    name: str | None = None
    total_bytes: int | None = None
    count: int = 1

    def describe(self) -> str:
        if self.source == "nvml":
            total = f" of {fmt_bytes(self.total_bytes)}" if self.total_bytes else ""
            more = f" (GPU 0 of {self.count})" if self.count > 1 else ""
            return f"{self.name or 'GPU'}{more}: {fmt_bytes(self.vram_bytes)} free{total} (NVML)"
        return f"vram {fmt_bytes(self.vram_bytes)} ({self.source})"


def nvml_budget() -> GpuBudget | None:
    """GPU 0's free memory through NVML, or None when nvidia-ml-py or a GPU is missing."""
    try:
        import pynvml  # nvidia-ml-py; optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: pynvml raises its own NVMLError subclasses
        return None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count < 1:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", errors="replace")
        return GpuBudget(
            "nvml", int(memory.free), name=str(name), total_bytes=int(memory.total), count=count
        )
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def find_budget(settings: Settings, sources: dict[str, str] | None = None) -> GpuBudget | None:
    """A set ``vram`` wins; else NVML (when ``detect_gpu``); else None (no GPU)."""
    if settings.vram:
        source = (sources or settings.sources()).get("vram", "set")
        return GpuBudget(source, parse_size(settings.vram))
    if settings.detect_gpu:
        return nvml_budget()
    return None


def gpu_offload_supported() -> bool:
    """Whether this llama-cpp-python build can put layers on a GPU."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


@dataclass
class DefaultsChoice:
    """The planned context settings, where each came from, and a note for the UI."""

    n_ctx: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_gpu_layers: int
    device: str  # "gpu", "partial" (some layers on the GPU) or "cpu"
    sources: dict[str, str]
    budget: GpuBudget | None = None
    vram_total: int | None = None  # the plan's VRAM figure for these settings
    warnings: list[str] = field(default_factory=list)
    reason: str | None = None  # why the CPU defaults (no budget found)
    # Which chat template the model gets when it is not its GGUF's own (see
    # kvchat.planner.templates), e.g. the GGUF has none: shown wherever the plan is.
    template_note: str | None = None
    # Why this plan replaced a bigger one the GPU failed to load (see retry_plan).
    retry_note: str = ""

    @property
    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PLANNED_FIELDS}

    def apply(self, settings: Settings) -> Settings:
        """A copy of ``settings`` with the chosen values."""
        return settings.model_copy(update=self.values)

    @property
    def note(self) -> str:
        """One line, e.g. "GPU plan for NVIDIA RTX 3060: 6.00 GiB free (NVML): n_ctx 32,768 …"."""
        kv = self.type_k if self.type_k == self.type_v else f"K {self.type_k}, V {self.type_v}"
        fa = "on" if self.flash_attn else "off"
        settings = f"n_ctx {self.n_ctx:,} · KV {kv} · flash attention {fa}"
        if self.device == "cpu":
            head = "CPU"
            if self.budget is not None and not self.warnings:
                head = f"CPU ({self.budget.describe()} holds no layer)"
            elif self.reason:
                head = f"CPU ({self.reason})"
        else:
            layers = "all layers" if self.n_gpu_layers < 0 else f"{self.n_gpu_layers} layers"
            settings += f" · {layers} on the GPU"
            head = f"GPU plan for {self.budget.describe()}" if self.budget else "GPU plan"
            if self.vram_total is not None:
                settings += f" (~{fmt_bytes(self.vram_total)} of VRAM)"
        explicit = [n for n in PLANNED_FIELDS if self.sources.get(n) not in ("plan", "default")]
        tail = f"; set by you: {', '.join(explicit)}" if explicit else ""
        warn = "".join(f" — {w}" for w in self.warnings)
        template = f" — {self.template_note}" if self.template_note else ""
        return f"{head}: {settings}{tail}{warn}{template}"

    def to_json(self) -> dict[str, Any]:
        return {
            **self.values,
            "device": self.device,
            "sources": {n: self.sources.get(n, "default") for n in PLANNED_FIELDS},
            "budget": asdict(self.budget) if self.budget else None,
            "vram_total": self.vram_total,
            "warnings": list(self.warnings),
            "reason": self.reason,
            "template_note": self.template_note,
            "note": self.note,
        }


# What llama.cpp and its GPU backends say when a model or context does not fit or cannot
# run on the GPU (lower case).
GPU_FAILURES = (
    "out of memory",
    "cudamalloc",
    "failed to allocate",
    "unable to allocate",
    "cuda error",
    "compute capability",
    "no kernel image",
    "failed to create llama_context",
    "failed to load model",
    "vk::",
    "vulkan",
    "ggml_backend",
)


def is_gpu_failure(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in GPU_FAILURES)


def retry_plan(choice: DefaultsChoice, config: Any, error: str) -> DefaultsChoice | None:
    """A smaller plan after the GPU failed to open the model with ``config`` (an
    EngineConfig made from ``choice``), or None when that failure is not the GPU's.

    Half the context first (not below :data:`MIN_CTX`; never a context the user set), then
    half the GPU layers (never a layer count the user set), down to none: the CPU. The new
    plan's ``retry_note`` and warnings say what failed and what is tried.
    """
    if config.n_gpu_layers == 0 or not is_gpu_failure(error):
        return None
    explicit = {n for n, source in choice.sources.items() if source not in ("plan", "default")}
    why = error.strip().splitlines()[-1][-160:] if error.strip() else "it failed"
    if "n_ctx" not in explicit and config.n_ctx // 2 >= MIN_CTX:
        n_ctx, layers = config.n_ctx // 2, config.n_gpu_layers
        what = f"n_ctx {n_ctx:,}"
    elif "n_gpu_layers" not in explicit:
        n_ctx, layers = config.n_ctx, config.n_gpu_layers
        if layers < 0:
            from kvchat.planner.gguf_info import read_gguf

            layers = read_gguf(config.model_path).n_layer + 1
        layers //= 2
        what = f"{layers} layers on the GPU" if layers else "no GPU offload (the CPU)"
    else:
        return None
    note = (
        f"the GPU could not open the model with {_plan_words(config)} ({why}): retried with {what}"
    )
    return replace(
        choice,
        n_ctx=n_ctx,
        n_gpu_layers=layers,
        device="cpu" if layers == 0 else "partial" if layers > 0 else choice.device,
        sources={**choice.sources, "n_ctx": choice.sources.get("n_ctx", "plan")},
        warnings=[*choice.warnings, note],
        retry_note=note,
    )


def _plan_words(config: Any) -> str:
    layers = "all layers" if config.n_gpu_layers < 0 else f"{config.n_gpu_layers} layers"
    return f"n_ctx {config.n_ctx:,} and {layers} on the GPU"


def plan_defaults(
    settings: Settings,
    model_path: Path | None = None,
    *,
    info: ModelInfo | None = None,
    budget: GpuBudget | None | bool = True,
    offload: bool | None = None,
) -> DefaultsChoice:
    """Choose the context settings for ``settings`` and the model at ``model_path``.

    ``budget`` (True: find it), ``info`` and ``offload`` can be given, for tests.
    With ``model_path``, the choice carries a note when the model's chat template is not
    its GGUF's own (:func:`template_note`).
    """
    choice = _plan_defaults(settings, model_path, info=info, budget=budget, offload=offload)
    if model_path is not None:
        choice.template_note = template_note(settings.chat_template, model_path)
    return choice


def template_note(setting: str | None, model_path: Path) -> str | None:
    """What the user should know about the chat template ``model_path`` gets: None when
    it is the GGUF's own; else which one and why (the GGUF has none: a guess, or the
    catalog's; the chat_template setting), or why the setting is unusable."""
    from kvchat.planner.gguf_info import has_chat_template
    from kvchat.planner.templates import catalog_template, choose_template

    try:
        own = "" if not has_chat_template(model_path) else "(the GGUF's)"
        return choose_template(setting, own or None, catalog_template(model_path)).note
    except KvchatError as exc:
        return str(exc)


def _plan_defaults(
    settings: Settings,
    model_path: Path | None = None,
    *,
    info: ModelInfo | None = None,
    budget: GpuBudget | None | bool = True,
    offload: bool | None = None,
) -> DefaultsChoice:
    sources = settings.sources()
    explicit = set(settings.model_fields_set)
    current = {name: getattr(settings, name) for name in PLANNED_FIELDS}
    planned_sources = {n: sources.get(n, "default") for n in PLANNED_FIELDS}
    if budget is True:
        budget = find_budget(settings, sources)
    gpu = budget if isinstance(budget, GpuBudget) else None

    def cpu(
        warnings: list[str] | None = None, ngl: int | None = None, reason: str | None = None
    ) -> DefaultsChoice:
        values = dict(current)
        if ngl is not None and "n_gpu_layers" not in explicit:
            values["n_gpu_layers"] = ngl
            planned_sources["n_gpu_layers"] = "plan"
        return DefaultsChoice(
            **values,
            device="cpu",
            sources=dict(planned_sources),
            budget=gpu,
            warnings=warnings or [],
            reason=reason,
        )

    if gpu is None:
        if not settings.detect_gpu:
            why = "GPU detection off (detect_gpu = false) and no vram set"
        else:
            why = "no GPU found through NVML (nvidia-ml-py) and no vram set"
        return cpu(reason=why)
    if offload is None:
        offload = gpu_offload_supported()
    if not offload:
        return cpu(
            [
                f"a GPU budget was found ({gpu.describe()}) but this llama-cpp-python "
                f"build cannot offload to a GPU; for CUDA: {CUDA_INSTALL}"
            ]
        )
    if info is None:
        if model_path is None:
            from kvchat.planner.model_lookup import model_path as named_model

            model_path = named_model(settings)
        from kvchat.planner.gguf_info import read_gguf

        info = read_gguf(model_path)
    return _gpu_plan(settings, info, gpu, explicit, current, planned_sources, cpu)


def _gpu_plan(
    settings: Settings,
    info: ModelInfo,
    gpu: GpuBudget,
    explicit: set[str],
    current: dict[str, Any],
    sources: dict[str, str],
    cpu: Any,
) -> DefaultsChoice:
    trained = info.context_length or current["n_ctx"]
    if "n_ctx" in explicit:
        target = current["n_ctx"]
    else:
        target = max(CTX_STEP, min(trained, AUTO_CTX_CAP) // CTX_STEP * CTX_STEP)
    flash = current["flash_attn"] if "flash_attn" in explicit else True
    if {"type_k", "type_v"} & explicit:
        candidates = [(current["type_k"], current["type_v"])]
    elif flash:
        candidates = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")]
    else:
        candidates = [("f16", "f16")]
    if candidates[0][1] != "f16" and not flash:
        raise KvchatError(
            f"a quantized V cache (type_v={candidates[0][1]}) needs flash "
            "attention: set flash_attn = true or keep type_v = f16"
        )
    full_ngl = info.n_layer + 1
    ngl = current["n_gpu_layers"] if "n_gpu_layers" in explicit else full_ngl

    def config(kv: tuple[str, str]) -> PlanConfig:
        return PlanConfig(
            vram_bytes=gpu.vram_bytes,
            type_k=kv[0],
            type_v=kv[1],
            flash_attn=flash,
            swa_full=settings.swa_full,
            n_ubatch=settings.n_batch,
        )

    reach = [(kv, max_context(info, ngl, config(kv), limit=target)) for kv in candidates]
    # 4-bit K/V costs quality: only when q8_0 falls short of GOOD_CTX (below), or when set.
    chosen: tuple[tuple[str, str], int] | None = next(
        ((kv, ctx) for kv, ctx in reach if ctx >= target and (kv[0] != "q4_0" or len(reach) == 1)),
        None,
    )
    if chosen is None and "n_ctx" not in explicit:
        by_type = dict(reach)
        if by_type.get(("q8_0", "q8_0"), 0) >= GOOD_CTX:
            chosen = (("q8_0", "q8_0"), by_type[("q8_0", "q8_0")])
        else:
            best = max(reach, key=lambda item: item[1])
            if best[1] >= MIN_CTX or "n_gpu_layers" in explicit:
                chosen = best
    warnings: list[str] = []
    if chosen is not None and chosen[1] > 0:
        kv, n_ctx = chosen
        if "n_gpu_layers" in explicit and n_ctx < target and "n_ctx" not in explicit:
            warnings.append(f"n_gpu_layers={ngl} leaves room for {n_ctx:,} tokens only")
    else:
        # Not even MIN_CTX with every layer on the GPU: offload as many layers as hold the
        # context, the rest (and their KV) run on the CPU.
        kv = candidates[1] if len(candidates) > 1 else candidates[0]
        n_ctx = target if "n_ctx" in explicit else min(target, PARTIAL_CTX)
        if "n_gpu_layers" in explicit:
            warnings.append(
                f"n_ctx {n_ctx:,} with n_gpu_layers={ngl} does not fit "
                f"{gpu.describe()}; llama.cpp may fail to allocate"
            )
        else:
            ngl = 0
            for k in range(info.n_layer, 0, -1):
                if memory_at(info, n_ctx, k, config(kv))["total"] <= gpu.vram_bytes:
                    ngl = k
                    break
            if ngl == 0:
                return cpu(ngl=0)
    values = dict(current)
    choice = {
        "n_ctx": n_ctx,
        "type_k": kv[0],
        "type_v": kv[1],
        "flash_attn": flash,
        "n_gpu_layers": -1 if ngl >= full_ngl else ngl,
    }
    for name, value in choice.items():
        if name not in explicit:
            values[name] = value
            sources[name] = "plan"
    used = memory_at(info, values["n_ctx"], values["n_gpu_layers"], config(kv))["total"]
    device = (
        "gpu" if values["n_gpu_layers"] < 0 or values["n_gpu_layers"] >= full_ngl else "partial"
    )
    return DefaultsChoice(
        **values,
        device=device,
        sources=dict(sources),
        budget=gpu,
        vram_total=used,
        warnings=warnings,
    )


__all__ = [
    "AUTO_CTX_CAP",
    "DefaultsChoice",
    "GpuBudget",
    "find_budget",
    "gpu_offload_supported",
    "nvml_budget",
    "is_gpu_failure",
    "plan_defaults",
    "retry_plan",
    "template_note",
]
