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
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from kvchat.engine.api import EngineConfig
from kvchat.engine.probe_book import OutcomeRecord, ProbeBook
from kvchat.errors import KvchatError
from kvchat.planner.gguf_info import read_gguf
from kvchat.system import current as current_system
from kvchat.text import one_line

PROBE_FILE = "engine-probe.json"
# Several homes on one machine (a test suite's) can share one file: the facts are the machine's.
PROBE_FILE_ENV = "KVCHAT_PROBE_FILE"
# The child's context: room for its prompt batch and the thread measurement (scratch cells).
PROBE_CTX = 512
# The prompt batch the child decodes in one go, and the tokens it then generates.
PROBE_PROMPT = 128
PROBE_GENERATE = 4
# The probe is waited for this long (setting probe_timeout_s, env KVCHAT_PROBE_TIMEOUT_S);
# past it the turn runs on the safe options (repacking off) and the probe finishes in the
# background, for at most BACKGROUND_FACTOR times as long, keeping its verdict for next time.
PROBE_TIMEOUT_S = 120.0
PROBE_TIMEOUT_ENV = "KVCHAT_PROBE_TIMEOUT_S"
BACKGROUND_FACTOR = 5
# Models this process loads with weight repacking on because the probe vouched for it (the
# test suite's guard allows no other repacked load).
VOUCHED_REPACK: set[str] = set()
# Generation this far below the probe's measurement (after a turn of at least
# COLLAPSE_MIN_TOKENS) makes the service measure the thread counts again.
COLLAPSE_RATIO = 0.35
COLLAPSE_MIN_TOKENS = 16
# The CPU flags that decide which kernels llama.cpp runs (part of the probe's key).
_CPU_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi", "vnni", "sve", "asimd")
AMX_ISSUE = "llama.cpp #20824"
# Why "auto" never runs weight repacking on an AMX CPU (the setting "on" still does).
AMX_NOT_RUN = (
    "not run on this CPU (AMX): its repacked kernels crash llama.cpp in virtual machines, "
    "and where they run a resumed turn's KV differs from a full prefill's"
)

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
        if amx and crash == AMX_NOT_RUN:
            return f"weight repacking off: {AMX_NOT_RUN}; see {AMX_ISSUE}"
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

    def to_record(self) -> OutcomeRecord:
        return OutcomeRecord.model_validate(self.to_json())

    @classmethod
    def from_record(cls, record: OutcomeRecord) -> ProbeOutcome:
        """An outcome from the file's checked record (see :mod:`kvchat.engine.probe_book`)."""
        return cls(
            key=record.key,
            trial=Trial(**record.trial.model_dump()),
            wanted=Trial(**record.wanted.model_dump()),
            failures=list(record.failures),
            speeds={n: {str(k): v for k, v in row.items()} for n, row in record.speeds.items()},
            probe_ms=record.probe_ms,
            when=record.when,
            amx=record.amx,
            recheck=record.recheck,
            model_bytes=record.model_bytes,
            model_name=record.model_name,
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
        off = (
            " with weight repacking off"
            if outcome.wanted.repack and not outcome.trial.repack
            else ""
        )
        return f"not judged ({outcome.inconclusive}): the options as asked{off}"
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

    for outcome in known_outcomes(directory):
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
    """The CPU's feature flags (empty where the OS does not say)."""
    return set(current_system().cpu().flags)


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
    measure ``thread_counts``; how it ended (a signal is a crash). The child dies with this
    process (it never outlives a kvchat that was killed) and after ``timeout`` seconds."""
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
        "parent": os.getpid(),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvchat.engine.probe_child", json.dumps(request)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **current_system().child_options(),  # the child dies with kvchat where it can
        )
    except OSError as exc:
        return ChildResult(False, error=f"the test run could not start ({exc})")
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return ChildResult(False, error=f"the test run took over {timeout:.0f} s")
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        detail = _native_message(stderr)
        return ChildResult(False, signal=f"killed by {name}{detail}")
    answer = child_answer(stdout)
    if proc.returncode == 0 and answer.get("ok") is True:
        return ChildResult(True, speeds=answer.get("speeds", {}))
    detail = _native_message(stderr)
    if detail:  # GGML_ASSERT and friends print, then abort: a crash too
        return ChildResult(False, signal=f"aborted{detail}")
    error = answer.get("error") or (stderr.strip().splitlines() or ["no answer"])[-1]
    return ChildResult(False, error=one_line(str(error))[:300])


def child_answer(stdout: str) -> dict[str, Any]:
    """The child's last line, checked like the file: ``{"ok": true, "speeds": {…}}`` with
    bounded speeds, or ``{"error": text}``; {} for anything else."""
    from kvchat.engine.openai_wire import loads

    last = stdout.strip().splitlines()[-1:] or [""]
    try:
        answer = loads(last[0], "the probe child's answer", cap=65536)
    except KvchatError:
        return {}
    if not isinstance(answer, dict):
        return {}
    if answer.get("ok") is True:
        try:
            speeds = OutcomeRecord.model_validate(
                {
                    "key": "0" * 24,
                    "trial": _ANY_TRIAL,
                    "wanted": _ANY_TRIAL,
                    "speeds": answer.get("speeds", {}),
                }
            ).speeds
        except ValidationError:
            return {}
        return {"ok": True, "speeds": {n: dict(row) for n, row in speeds.items()}}
    return {"error": str(answer.get("error", ""))}


_ANY_TRIAL = {"repack": False, "flash_attn": False, "n_gpu_layers": 0}


def _native_message(stderr: str) -> str:
    """`` (GGML_ASSERT(…) failed)`` when llama.cpp said why it aborted, else ''."""
    for line in stderr.splitlines():
        if "GGML_ASSERT" in line or "GGML_ABORT" in line or "ggml_abort" in line:
            return f" ({one_line(line)[:160]})"
    return ""


def probe_timeout(default: float = PROBE_TIMEOUT_S) -> float:
    """``$KVCHAT_PROBE_TIMEOUT_S`` when it is a number from 1 to 3,600, else ``default``."""
    raw = os.environ.get(PROBE_TIMEOUT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if 1.0 <= value <= 3600.0 else default


def safe_trial(wanted: Trial, repack_fixed: bool) -> Trial:
    """What runs where the probe has not vouched for ``wanted``: weight repacking off (its
    AMX kernels are what crash llama.cpp on the machines where it crashes), unless the
    setting fixes it on."""
    return wanted if repack_fixed else replace(wanted, repack=False)


@dataclass
class _Judgement:
    """The fallback trials run in order until one works (in a thread of its own)."""

    config: EngineConfig
    trials: list[Trial]
    wanted: Trial
    counts: list[int]
    timeout: float
    failures: list[str]
    repack_fixed: bool
    trial: Trial | None = None
    result: ChildResult | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            for trial in self.trials:
                self.trial, self.result = (
                    trial,
                    run_child(trial.apply(self.config), self.counts, self.timeout),
                )
                if self.result.ok or not self.result.crashed:
                    return
                self.failures.append(f"{_label(trial, self.wanted)}: {self.result.signal}")
            self.trial = None
        finally:
            self.done.set()


def run_probe(
    config: EngineConfig,
    *,
    repack_fixed: bool,
    physical: int,
    book: ProbeBook | None,
    timeout: float | None = None,
) -> ProbeOutcome:
    """The outcome for ``config`` from ``book``, or found by child runs (and kept).

    A verdict that crashed in use (see :meth:`ProbeBook.withdraw_crashed`) is probed again
    from the next safer combination. The probe is waited for ``timeout`` seconds (default:
    :func:`probe_timeout`); past that the outcome is not judged and the options the probe has
    not vouched for are off (:func:`safe_trial`), while the probe finishes in the background
    (up to :data:`BACKGROUND_FACTOR` times as long) and keeps its verdict for the next start.
    """
    wait = probe_timeout() if timeout is None else timeout
    wanted = Trial.of(config)
    facts = machine_facts(config.model_path)
    key = probe_key(facts, wanted)
    trials = wanted.fallbacks(repack_fixed, gpu=bool(facts["gpu_offload"]))
    amx = has_amx(set(facts["cpu"]))
    failures: list[str] = []
    if book is not None:
        book.withdraw_crashed()
        known = book.get(key)
        amx_repacked = known is not None and known.trial.repack and amx and not repack_fixed
        if known is not None and not known.withdrawn and not amx_repacked:
            return ProbeOutcome.from_record(known)
        if known is not None and known.withdrawn:
            trials, failures = _after_crash_in_use(known, wanted, trials)
    if trials[0].repack and amx and not repack_fixed:
        # Not even tried: on an AMX CPU repacked weights crash llama.cpp (in virtual
        # machines) or, where they run, give a resumed turn other KV than a full prefill.
        failures = [*failures, f"{_label(trials[0], wanted)}: {AMX_NOT_RUN}"]
        trials = trials[1:]
    started = time.perf_counter()
    counts = thread_candidates(physical, os.cpu_count())
    judgement = _Judgement(
        config, trials, wanted, counts, wait * BACKGROUND_FACTOR, failures, repack_fixed
    )

    def outcome_of(done: _Judgement) -> ProbeOutcome:
        return _outcome(config, key, wanted, facts, done, started)

    def keep_later() -> None:
        judgement.done.wait()
        outcome = outcome_of(judgement)
        if book is not None and not outcome.inconclusive:
            book.put(outcome.to_record())

    worker = threading.Thread(target=judgement.run, name="kvchat-probe", daemon=True)
    worker.start()
    if not judgement.done.wait(wait):
        threading.Thread(target=keep_later, name="kvchat-probe-keep", daemon=True).start()
        outcome = ProbeOutcome(
            key=key,
            trial=safe_trial(wanted, repack_fixed),
            wanted=wanted,
            failures=list(failures),
            when=_now(),
            amx=has_amx(set(facts["cpu"])),
            fresh=True,
            inconclusive=f"the test run took over {wait:.0f} s; it goes on in the background",
        )
        return outcome
    outcome = outcome_of(judgement)
    if judgement.trial is None:
        raise KvchatError(
            "llama.cpp crashes on this machine whatever kvchat turns off ("
            + "; ".join(judgement.failures)
            + "); see `kvchat doctor`"
        )
    if book is not None and not outcome.inconclusive:
        book.put(outcome.to_record())
    return outcome


def _after_crash_in_use(
    known: OutcomeRecord, wanted: Trial, trials: list[Trial]
) -> tuple[list[Trial], list[str]]:
    """The trials to probe again after the verdict ``known`` crashed in use, and the failures
    so far: from the crashed combination itself (a stale or shared file's verdict, which the
    child then sees crash), or past it when it already crashed in use once before."""
    crashed = Trial(**known.trial.model_dump())
    note = f"{_label(crashed, wanted)}: crashed in use"
    failures = [*known.failures, note][-16:]
    if crashed not in trials:
        return trials, failures
    at = trials.index(crashed)
    if known.failures.count(note) and at + 1 < len(trials):
        at += 1
    return trials[at:], failures


def _outcome(
    config: EngineConfig,
    key: str,
    wanted: Trial,
    facts: dict[str, Any],
    done: _Judgement,
    started: float,
) -> ProbeOutcome:
    result = done.result or ChildResult(False, error="the test run did not start")
    outcome = ProbeOutcome(
        key=key,
        trial=done.trial or wanted,
        wanted=wanted,
        failures=list(done.failures),
        speeds=result.speeds,
        probe_ms=(time.perf_counter() - started) * 1000,
        when=_now(),
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
        # real load reports that itself; nothing is kept, and what the probe did not vouch
        # for stays off.
        outcome.trial = safe_trial(done.trial or wanted, done.repack_fixed)
        outcome.inconclusive = result.error
    return outcome


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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
    timeout: float | None = None,
    in_use: bool = False,
) -> tuple[EngineConfig, ProbeOutcome | None]:
    """``config`` with what the probe found safe (and, with ``threads``, fastest).

    ``repack`` "on"/"off" fixes weight repacking (the probe then only guards the other
    options); with it fixed and no thread choice wanted, nothing is probed. ``in_use``: this
    process is about to run the model on the verdict (a crash then withdraws it).
    """
    from kvchat.config import physical_cores

    if repack != "auto" and not threads:
        return replace(config, repack=repack == "on"), None
    if repack != "auto":
        config = replace(config, repack=repack == "on")
    book = ProbeBook(probe_file(directory))
    outcome = run_probe(
        config,
        repack_fixed=repack != "auto",
        physical=physical_cores(),
        book=book,
        timeout=timeout,
    )
    chosen = outcome.trial.apply(config)
    if in_use and not outcome.inconclusive:
        from kvchat.crashes import current_crash_log

        book.mark_in_use(outcome.key, current_crash_log())
    if chosen.repack:
        VOUCHED_REPACK.add(str(config.model_path))
    if threads:
        gen, batch = outcome.best_threads("generate"), outcome.best_threads("prefill")
        if gen is not None:
            measured = tuple(
                (int(n), row.get("prefill", 0.0), row.get("generate", 0.0))
                for n, row in sorted(outcome.speeds.items(), key=lambda kv: int(kv[0]))
            )
            chosen = replace(chosen, n_threads=gen, n_threads_batch=batch, thread_speeds=measured)
    return chosen, outcome


def known_outcomes(directory: Path | None = None) -> list[ProbeOutcome]:
    """The verdicts kept on this machine, the newest first (withdrawn ones left out)."""
    book = ProbeBook(probe_file(directory))
    return [ProbeOutcome.from_record(r) for r in book.records() if not r.withdrawn]


def _cpu_model() -> str:
    model = current_system().cpu().model
    if model:
        return model
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
