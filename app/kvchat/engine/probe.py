"""Whether this llama.cpp build runs on this machine, tried in a child process first.

llama.cpp can crash in native code on a machine it was not tried on: on Intel CPUs with AMX,
its repacked weights crash the first decode in virtualized guests (llama.cpp #20824,
#11115). A segfault cannot be caught in the process it happens in, so before a model is
trusted on a combination of (llama.cpp build, CPU, GPU and driver, the model's weight
types, the risky options asked for), a child process loads it and runs what a turn runs:
a full prompt batch and a few generated tokens (:mod:`kvchat.engine.probe_child`). If the
child dies by a signal, the same is tried with weight repacking off, then flash attention
off, then GPU offload off, and the first combination that works is used. The child that
works also measures prefill and generation speed for a few thread counts, and the fastest
are chosen. Outcomes are kept in ``engine-probe.json`` in the data directory, keyed by the
combination, so later starts read one small file.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kvchat.engine.api import EngineConfig
from kvchat.errors import KvchatError
from kvchat.planner.gguf_info import read_gguf

PROBE_FILE = "engine-probe.json"
# Several homes on one machine (a test suite's) can share one file: the facts are the machine's.
PROBE_FILE_ENV = "KVCHAT_PROBE_FILE"
# The child's context: room for its prompt batch and the thread measurement (scratch cells).
PROBE_CTX = 512
# The prompt batch the child decodes in one go, and the tokens it then generates.
PROBE_PROMPT = 128
PROBE_GENERATE = 4
# A model that takes longer than this to load and run one batch is not judged: its outcome
# is not kept, and the options asked for are used.
PROBE_TIMEOUT_S = 300.0
# Generation this far below the probe's measurement (after a turn of at least
# COLLAPSE_MIN_TOKENS) makes the service measure the thread counts again.
COLLAPSE_RATIO = 0.35
COLLAPSE_MIN_TOKENS = 16
# The CPU flags that decide which kernels llama.cpp runs (part of the probe's key).
_CPU_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi", "vnni", "sve", "asimd")
AMX_ISSUE = "llama.cpp #20824"

RepackSetting = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class Trial:
    """One combination of the options that can crash llama.cpp on a machine."""

    repack: bool
    flash_attn: bool
    n_gpu_layers: int
    type_k: str = "f16"
    type_v: str = "f16"

    @classmethod
    def of(cls, config: EngineConfig) -> Trial:
        return cls(
            repack=config.repack is not False,
            flash_attn=config.flash_attn,
            n_gpu_layers=config.n_gpu_layers,
            type_k=config.type_k,
            type_v=config.type_v,
        )

    def fallbacks(self, repack_fixed: bool, gpu: bool) -> list[Trial]:
        """This trial, then with repacking off (unless fixed by the setting), then flash
        attention off (a quantized V cache needs it: f16 then), then no GPU offload (where
        this llama.cpp build has any: ``gpu``)."""
        trials = [self]
        current = self
        if current.repack and not repack_fixed:
            current = replace(current, repack=False)
            trials.append(current)
        if current.flash_attn:
            current = replace(current, flash_attn=False, type_v="f16")
            trials.append(current)
        if gpu and current.n_gpu_layers != 0:
            current = replace(current, n_gpu_layers=0)
            trials.append(current)
        return trials

    def apply(self, config: EngineConfig) -> EngineConfig:
        return replace(
            config,
            repack=self.repack,
            flash_attn=self.flash_attn,
            n_gpu_layers=self.n_gpu_layers,
            type_k=self.type_k,
            type_v=self.type_v,
        )

    def changes_from(self, wanted: Trial) -> list[str]:
        """What this trial turned off that ``wanted`` had on, in words."""
        changed = []
        if wanted.repack and not self.repack:
            changed.append("weight repacking off")
        if wanted.flash_attn and not self.flash_attn:
            changed.append("flash attention off")
        if wanted.n_gpu_layers != 0 and self.n_gpu_layers == 0:
            changed.append("GPU offload off")
        return changed


@dataclass
class ProbeOutcome:
    """What the probe chose for one combination, why, and the speeds it measured."""

    key: str
    trial: Trial
    wanted: Trial
    # Each crashed combination, e.g. "weight repacking on: killed by SIGSEGV".
    failures: list[str] = field(default_factory=list)
    # Tokens per second by thread count: {"2": {"prefill": 310.0, "generate": 24.1}}.
    speeds: dict[str, dict[str, float]] = field(default_factory=dict)
    probe_ms: float = 0.0
    when: str = ""
    amx: bool = False
    # How the threads were last re-checked (a slowdown seen during a turn), or "".
    recheck: str = ""
    # The weights' size and name of the model measured (to scale its speed to others).
    model_bytes: int = 0
    model_name: str = ""
    # True on the start that ran the probe (the choice is said then), False once read back.
    fresh: bool = False
    # Why the probe did not judge (it could not run, or took too long): nothing is kept.
    inconclusive: str | None = None

    @property
    def changes(self) -> list[str]:
        return self.trial.changes_from(self.wanted)

    @property
    def reason(self) -> str | None:
        """One line when the probe turned something off, e.g. "weight repacking off:
        llama.cpp crashed with it on this CPU (AMX); see llama.cpp #20824"; else None."""
        if not self.changes:
            return None
        crash = self.failures[0].split(": ", 1)[-1] if self.failures else "it crashed"
        amx = self.amx and self.changes[0] == "weight repacking off"
        where = "this CPU (AMX)" if amx else "this machine"
        line = f"{', '.join(self.changes)}: llama.cpp crashed with the faster settings on {where}"
        line += f" ({crash} in a test run)"
        return line + (f"; see {AMX_ISSUE}" if amx else "")

    def best_threads(self, kind: str) -> int | None:
        """The thread count with the highest measured ``kind`` ("prefill"/"generate") speed."""
        return fastest(self.speeds, kind)

    def speed(self, n_threads: int, kind: str = "generate") -> float | None:
        row = self.speeds.get(str(n_threads))
        return row.get(kind) if row else None

    def threads_line(self) -> str | None:
        """E.g. "threads: 1 for generation (24.3 tok/s; 2: 9.1), 2 for prompts (…)"."""
        gen, batch = self.best_threads("generate"), self.best_threads("prefill")
        if gen is None or batch is None:
            return None

        def rates(kind: str, chosen: int) -> str:
            others = [
                f"{n}: {row.get(kind, 0.0):.1f}"
                for n, row in sorted(self.speeds.items(), key=lambda kv: int(kv[0]))
                if int(n) != chosen
            ]
            main = f"{self.speeds[str(chosen)].get(kind, 0.0):.1f} tok/s"
            return main + (f"; {', '.join(others)}" if others else "")

        line = (
            f"threads: {gen} for generation ({rates('generate', gen)}), "
            f"{batch} for prompts ({rates('prefill', batch)}), as measured"
        )
        return line + (f"; {self.recheck}" if self.recheck else "")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for transient in ("fresh", "inconclusive"):
            data.pop(transient)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeOutcome:
        return cls(
            key=str(data["key"]),
            trial=Trial(**data["trial"]),
            wanted=Trial(**data["wanted"]),
            failures=[str(f) for f in data.get("failures", [])],
            speeds={
                str(n): {str(k): float(v) for k, v in row.items()}
                for n, row in dict(data.get("speeds", {})).items()
            },
            probe_ms=float(data.get("probe_ms", 0.0)),
            when=str(data.get("when", "")),
            amx=bool(data.get("amx", False)),
            recheck=str(data.get("recheck", "")),
            model_bytes=int(data.get("model_bytes", 0)),
            model_name=str(data.get("model_name", "")),
        )


def fastest(speeds: dict[str, dict[str, float]], kind: str) -> int | None:
    """The thread count with the highest ``kind`` ("prefill"/"generate") speed in ``speeds``
    (the fewer threads on a tie), or None when nothing was measured."""
    rated = [(row.get(kind, 0.0), int(n)) for n, row in speeds.items()]
    rated = [(speed, n) for speed, n in rated if speed > 0]
    if not rated:
        return None
    return max(rated, key=lambda item: (item[0], -item[1]))[1]


def probe_words(outcome: ProbeOutcome) -> str:
    """The probe's choice in words: "all as asked" or what it turned off and why."""
    if outcome.inconclusive:
        return f"not judged ({outcome.inconclusive}): the options as asked"
    trial = outcome.trial
    options = (
        f"weight repacking {'on' if trial.repack else 'off'}, flash attention "
        f"{'on' if trial.flash_attn else 'off'}"
    )
    if trial.n_gpu_layers == 0 and outcome.wanted.n_gpu_layers != 0:
        options += ", GPU offload off"
    return f"{options}; {outcome.reason}" if outcome.reason else f"{options} (as asked; it ran)"


def measured_speed(directory: Path | None = None) -> Any:
    """The newest generation speed the probe measured on this machine, with the model it
    was measured on (a :class:`kvchat.planner.cpu.Measured`), or None."""
    from kvchat.planner.cpu import Measured

    for outcome in ProbeBook(probe_file(directory)).outcomes():
        best = outcome.best_threads("generate")
        speed = outcome.speed(best, "generate") if best is not None else None
        if speed and outcome.model_bytes:
            return Measured(speed, outcome.model_bytes, outcome.model_name)
    return None


def probe_file(directory: Path | None = None) -> Path:
    """``$KVCHAT_PROBE_FILE``, else ``engine-probe.json`` in ``directory`` (default: the
    data directory)."""
    shared = os.environ.get(PROBE_FILE_ENV)
    if shared:
        return Path(shared).expanduser()
    if directory is None:
        from kvchat.paths import data_dir

        directory = data_dir()
    return directory / PROBE_FILE


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def has_amx(flags: set[str] | None = None) -> bool:
    return any(flag.startswith("amx") for flag in (cpu_flags() if flags is None else flags))


def machine_facts(model_path: Path) -> dict[str, Any]:
    """What decides which native code a turn runs: the build, the CPU, the GPU, the weights."""
    import llama_cpp

    from kvchat.planner.defaults import nvml_budget

    flags = cpu_flags()
    budget = nvml_budget() if llama_cpp.llama_supports_gpu_offload() else None
    try:
        weights = sorted(read_gguf(model_path).weight_types)
    except KvchatError:
        weights = []
    system = llama_cpp.llama_print_system_info()
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system": system.decode("utf-8", "replace") if system else "",
        "cpu": sorted(f for f in flags if f.startswith(_CPU_FLAG_PREFIXES)),
        "cpu_model": _cpu_model(),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "gpu": budget.name if budget is not None else None,
        "gpu_driver": _gpu_driver() if budget is not None else None,
        "weights": weights,
    }


def probe_key(facts: dict[str, Any], wanted: Trial) -> str:
    text = json.dumps({"facts": facts, "wanted": asdict(wanted)}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def thread_candidates(physical: int, logical: int | None = None) -> list[int]:
    """Thread counts worth measuring: every count up to 4 cores, else the physical cores,
    half and a quarter of them (and the logical CPUs where there are more)."""
    physical = max(1, physical)
    if physical <= 4:
        counts = set(range(1, physical + 1))
    else:
        counts = {physical, max(1, physical // 2), max(1, physical // 4)}
    if logical and logical > physical:
        counts.add(logical)
    return sorted(counts, reverse=True)


class ProbeBook:
    """The outcomes file: one JSON object, written whole to a temporary name and renamed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # absent or damaged: probed again, then rewritten
        outcomes = data.get("outcomes") if isinstance(data, dict) else None
        return outcomes if isinstance(outcomes, dict) else {}

    def get(self, key: str) -> ProbeOutcome | None:
        data = self.read().get(key)
        if not isinstance(data, dict):
            return None
        try:
            return ProbeOutcome.from_json(data)
        except (KeyError, TypeError, ValueError):
            return None

    def outcomes(self) -> list[ProbeOutcome]:
        found = [self.get(key) for key in self.read()]
        return sorted((o for o in found if o), key=lambda o: o.when, reverse=True)

    def put(self, outcome: ProbeOutcome) -> None:
        """Keep ``outcome`` (best effort: an unwritable directory means probing again)."""
        from kvchat.paths import ensure_private_dir

        outcomes = self.read()
        outcomes[outcome.key] = outcome.to_json()
        try:
            ensure_private_dir(self.path.parent)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": 1, "outcomes": outcomes}, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temporary, self.path)
        except (OSError, KvchatError):
            pass


@dataclass
class ChildResult:
    """How one child run ended: ``ok``, or the signal or error that ended it."""

    ok: bool
    signal: str | None = None
    error: str | None = None
    speeds: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def crashed(self) -> bool:
        return self.signal is not None


def run_child(
    config: EngineConfig, thread_counts: list[int], timeout: float = PROBE_TIMEOUT_S
) -> ChildResult:
    """Load ``config``'s model in a child process, run a prompt batch and a few tokens, and
    measure ``thread_counts``; how it ended (a signal is a crash)."""
    request = {
        "model_path": str(config.model_path),
        "n_batch": config.n_batch,
        "n_threads": config.n_threads,
        "n_gpu_layers": config.n_gpu_layers,
        "type_k": config.type_k,
        "type_v": config.type_v,
        "flash_attn": config.flash_attn,
        "repack": bool(config.repack),
        "thread_counts": thread_counts,
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvchat.engine.probe_child", json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return ChildResult(False, error=f"the test run took over {timeout:.0f} s")
    except OSError as exc:
        return ChildResult(False, error=f"the test run could not start ({exc})")
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        detail = _native_message(proc.stderr)
        return ChildResult(False, signal=f"killed by {name}{detail}")
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        answer = json.loads(last[0])
    except ValueError:
        answer = {}
    if proc.returncode == 0 and answer.get("ok"):
        return ChildResult(True, speeds=answer.get("speeds", {}))
    detail = _native_message(proc.stderr)
    if detail:  # GGML_ASSERT and friends print, then abort: a crash too
        return ChildResult(False, signal=f"aborted{detail}")
    error = answer.get("error") or (proc.stderr.strip().splitlines() or ["no answer"])[-1]
    return ChildResult(False, error=str(error))


def _native_message(stderr: str) -> str:
    """`` (GGML_ASSERT(…) failed)`` when llama.cpp said why it aborted, else ''."""
    for line in stderr.splitlines():
        if "GGML_ASSERT" in line or "GGML_ABORT" in line or "ggml_abort" in line:
            return f" ({line.strip()[:160]})"
    return ""


def run_probe(
    config: EngineConfig,
    *,
    repack_fixed: bool,
    physical: int,
    book: ProbeBook | None,
) -> ProbeOutcome:
    """The outcome for ``config`` from ``book``, or found by child runs (and kept)."""
    wanted = Trial.of(config)
    facts = machine_facts(config.model_path)
    key = probe_key(facts, wanted)
    if book is not None:
        known = book.get(key)
        if known is not None:
            return known
    started = time.perf_counter()
    counts = thread_candidates(physical, os.cpu_count())
    failures: list[str] = []
    for trial in wanted.fallbacks(repack_fixed, gpu=bool(facts["gpu_offload"])):
        result = run_child(trial.apply(config), counts)
        if result.ok or not result.crashed:
            break
        failures.append(f"{_label(trial, wanted)}: {result.signal}")
    else:
        raise KvchatError(
            "llama.cpp crashes on this machine whatever kvchat turns off ("
            + "; ".join(failures)
            + "); see `kvchat doctor`"
        )
    outcome = ProbeOutcome(
        key=key,
        trial=trial,
        wanted=wanted,
        failures=failures,
        speeds=result.speeds,
        probe_ms=(time.perf_counter() - started) * 1000,
        when=datetime.now(UTC).isoformat(timespec="seconds"),
        amx=has_amx(set(facts["cpu"])),
        fresh=True,
    )
    try:
        info = read_gguf(config.model_path)
        outcome.model_bytes, outcome.model_name = info.weight_bytes, info.name
    except KvchatError:
        pass
    if not result.ok:
        # Not a crash: the child could not run (a model it cannot load, a timeout). The
        # real load reports that itself; nothing is kept, the options stay as asked.
        outcome.trial = wanted
        outcome.inconclusive = result.error
        return outcome
    if book is not None:
        book.put(outcome)
    return outcome


def _label(trial: Trial, wanted: Trial) -> str:
    changes = trial.changes_from(wanted)
    on = "weight repacking on" if trial.repack else "as asked"
    return ", ".join(changes) if changes else on


def probed_config(
    config: EngineConfig,
    *,
    repack: RepackSetting = "auto",
    threads: bool = False,
    directory: Path | None = None,
) -> tuple[EngineConfig, ProbeOutcome | None]:
    """``config`` with what the probe found safe (and, with ``threads``, fastest).

    ``repack`` "on"/"off" fixes weight repacking (the probe then only guards the other
    options); with it fixed and no thread choice wanted, nothing is probed.
    """
    from kvchat.config import physical_cores

    if repack != "auto" and not threads:
        return replace(config, repack=repack == "on"), None
    if repack != "auto":
        config = replace(config, repack=repack == "on")
    outcome = run_probe(
        config,
        repack_fixed=repack != "auto",
        physical=physical_cores(),
        book=ProbeBook(probe_file(directory)),
    )
    chosen = outcome.trial.apply(config)
    if threads:
        gen, batch = outcome.best_threads("generate"), outcome.best_threads("prefill")
        if gen is not None:
            measured = tuple(
                (int(n), row.get("prefill", 0.0), row.get("generate", 0.0))
                for n, row in sorted(outcome.speeds.items(), key=lambda kv: int(kv[0]))
            )
            chosen = replace(chosen, n_threads=gen, n_threads_batch=batch, thread_speeds=measured)
    return chosen, outcome


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _gpu_driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML, no driver
        return None


__all__ = [
    "COLLAPSE_MIN_TOKENS",
    "COLLAPSE_RATIO",
    "ProbeBook",
    "fastest",
    "measured_speed",
    "ProbeOutcome",
    "Trial",
    "probe_file",
    "probe_words",
    "probed_config",
    "run_probe",
    "thread_candidates",
]
