"""``kvchat bench``'s results: the rows, the machine they were measured on, and the tables.

See :mod:`kvchat.bench.runs` for what is measured and how.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.engine import Engine
from kvchat.planner.plan import attention_of


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in values.items()}


@dataclass
class BenchRow:
    tokens: int
    snapshot_bytes: int
    restore_ms: float
    limit_ms: float
    restore_over_limit: float
    ttft_resume_ms: float
    ttft_prefill_ms: float
    speedup: float
    decoded_resume: int
    decoded_prefill: int
    restore_blob_ms: float
    chunks_over_blob: float
    restore_ram_ms: float
    # The same new message with the session already in the context (no restore at all).
    ttft_hot_ms: float = 0.0
    # prefill ÷ (llama.cpp's load + the hot turn): the most a restore could give.
    limit_speedup: float = 0.0
    speedup_of_limit: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return _rounded(asdict(self))


@dataclass
class WriteRow:
    turn: int
    history_tokens: int
    new_tokens: int
    written_bytes: int
    new_kv_bytes: int
    written_over_new: float
    blob_bytes: int

    def to_json(self) -> dict[str, Any]:
        return _rounded(asdict(self))


@dataclass
class LayoutRow:
    """Restores of one history length in one V layout: flash attention on (V stored as rows)
    or off (V transposed), ours from chunks and from a blob against llama.cpp's loader."""

    tokens: int
    flash_attn: bool
    restore_ms: float
    limit_ms: float
    restore_over_limit: float
    restore_blob_ms: float
    blob_over_limit: float

    def to_json(self) -> dict[str, Any]:
        return _rounded({**asdict(self), "v_transposed": not self.flash_attn})


@dataclass
class BenchReport:
    rows: list[BenchRow] = field(default_factory=list)
    writes: list[WriteRow] = field(default_factory=list)
    forks: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    # Chunk restores in both V layouts; why the other layout was not measured, or None.
    layouts: list[LayoutRow] = field(default_factory=list)
    layouts_note: str | None = None
    # Tokens/s with the thread counts in use vs the physical cores (see bench._bench_threads).
    threads: dict[str, Any] = field(default_factory=dict)
    # The run's own time against what was said up front.
    estimate_s: float = 0.0
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "headline": headline(self),
            "estimate_s": round(self.estimate_s, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "threads": self.threads,
            "rows": [r.to_json() for r in self.rows],
            "layouts": [r.to_json() for r in self.layouts],
            "layouts_note": self.layouts_note,
            "writes": [w.to_json() for w in self.writes],
            "forks": _rounded(self.forks),
            "machine": self.machine,
        }


def machine(engine: Engine) -> dict[str, Any]:
    """Where the figures were measured: cores, GPU, load, the model and its context."""
    config = engine.config
    caps = engine.capabilities
    metadata = engine.metadata
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {
        "cpu_cores": os.cpu_count() or 0,
        "cpu_usable": usable,
        "threads": config.n_threads,
        "gpu": bool(caps.gpu_offload and config.n_gpu_layers != 0),
        "gpu_offload_build": caps.gpu_offload,
        "n_gpu_layers": config.n_gpu_layers,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "model_file": str(config.model_path),
        "model_bytes": Path(config.model_path).stat().st_size,
        "architecture": str(metadata.get("general.architecture", "unknown")),
        "attention": attention_of(config.model_path),
        "n_ctx": engine.n_ctx,
        "type_k": config.type_k,
        "type_v": config.type_v,
        "flash_attn": config.flash_attn,
    }


def machine_line(info: dict[str, Any]) -> str:
    """The machine as a header line for the tables."""
    if not info:
        return ""
    gpu = f"GPU ({info['n_gpu_layers']} layers)" if info["gpu"] else "no GPU"
    if not info["gpu"] and info["gpu_offload_build"]:
        gpu += " (offload off)"
    load = ", ".join(f"{x:.2f}" for x in info["load_avg"])
    end = info.get("load_avg_end")
    if end:
        load += " → " + ", ".join(f"{x:.2f}" for x in end)
    kv = (
        info["type_k"] if info["type_k"] == info["type_v"] else f"{info['type_k']}/{info['type_v']}"
    )
    return (
        f"machine: {info['cpu_cores']} CPU cores ({info['cpu_usable']} usable, "
        f"{info['threads']} threads), {gpu}, load average {load}\n"
        f"model: {info['model_file']} ({info['architecture']}, {info.get('attention', '?')}, "
        f"{info['model_bytes'] / 2**20:,.0f} MiB), n_ctx {info['n_ctx']:,}, KV {kv}, "
        f"flash attention {'on' if info['flash_attn'] else 'off'}"
    )


def seconds_words(ms: float) -> str:
    """Milliseconds as seconds a reader takes in at a glance: 21.4 → "0.02 s", 2312 → "2.3 s",
    13185 → "13 s", 184000 → "184 s"."""
    secs = ms / 1000
    if secs >= 10:
        return f"{secs:,.0f} s"
    if secs >= 1:
        return f"{secs:.1f} s"
    if secs >= 0.01:
        return f"{secs:.2f} s"
    return f"{secs:.3f} s"


def times_words(ratio: float) -> str:
    """A ratio as "113×", "2.4×" or "0.86×"."""
    if ratio >= 10:
        return f"{ratio:,.0f}×"
    if ratio >= 1:
        return f"{ratio:.1f}×"
    return f"{ratio:.2f}×"


def headline(report: BenchReport) -> list[str]:
    """What the run found, in words, before any table: the longest conversation's resume
    against reading it again, the restore against llama.cpp's own loader, RAM, writes, forks."""
    lines: list[str] = []
    mib = 2**20
    if report.rows:
        r = max(report.rows, key=lambda row: row.tokens)
        lines.append(
            f"resuming a {r.tokens:,}-token conversation from disk: first word in "
            f"{seconds_words(r.ttft_resume_ms)} instead of {seconds_words(r.ttft_prefill_ms)} "
            f"— {times_words(r.speedup)} sooner"
        )
        if r.limit_ms:
            pace = "faster than" if r.restore_over_limit < 1 else "slower than"
            lines.append(
                f"reading its {r.snapshot_bytes / mib:,.0f} MiB of KV back took "
                f"{r.restore_ms:.1f} ms: {times_words(r.restore_over_limit)} the time of "
                f"llama.cpp's own state loader ({r.limit_ms:.1f} ms), {pace} it"
            )
        if r.restore_ram_ms:
            lines.append(
                f"switching back to it from RAM: its KV in place in {r.restore_ram_ms:.1f} ms"
            )
    if report.writes:
        last = report.writes[-1]
        per_turn = sum(w.written_bytes for w in report.writes) / len(report.writes)
        lines.append(
            f"each turn writes only its new tokens' KV: {per_turn / mib:.1f} MiB a turn over "
            f"{len(report.writes)} turns, where saving the whole state would write "
            f"{last.blob_bytes / mib:.0f} MiB by the last"
        )
    if report.forks:
        f = report.forks
        lines.append(
            f"{f['forks']} branches of one {f['prefix_tokens']:,}-token conversation take "
            f"{f['disk_bytes'] / mib:.0f} MiB on disk, {f['disk_over_blobs']:.0%} of saving "
            f"each one whole ({f['whole_blob_bytes'] / mib:.0f} MiB)"
        )
    return lines


# (header, what the column means): one line each under the table.
RESUME_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tokens", "the conversation's length when it is resumed"),
    ("on disk", "its KV as kvchat stores it"),
    (
        "restore",
        "kvchat reading that KV back from disk: validate, read, checksum, hand to "
        "llama.cpp (median)",
    ),
    ("llama.cpp", "llama.cpp's own llama_state_seq_load_file of the same state: the floor"),
    (
        "÷llama",
        "restore ÷ llama.cpp: under 1.00× kvchat is faster than llama.cpp's loader, over it slower",
    ),
    ("blob", "the same restore from kvchat's whole-file format"),
    ("RAM", "the same KV back from memory, as after switching between conversations"),
    ("resumed", "time to the first word of the next message (~20 tokens) after a restore"),
    ("hot", "the same with the conversation still in the context (no restore at all)"),
    ("re-read", "the same with no KV kept: the whole history read again"),
    ("sooner", "re-read ÷ resumed: how many times sooner the first word comes"),
    ("best", "re-read ÷ (llama.cpp + hot): the most any restore could give"),
    ("reached", "sooner ÷ best: 100% is as good as a restore can be"),
)


def column_notes(columns: tuple[tuple[str, str], ...]) -> list[str]:
    """One line per column: "  restore    kvchat reading …"."""
    width = max(len(name) for name, _ in columns)
    return [f"  {name:<{width}}  {meaning}" for name, meaning in columns]


def format_report(report: BenchReport) -> str:
    mib = 2**20
    lines = [*headline(report)]
    if report.machine:
        lines += ["", machine_line(report.machine)]
    if report.elapsed_s:
        lines.append(
            f"took {report.elapsed_s:.0f} s (estimated {report.estimate_s:.0f} s); "
            "every ratio is against a baseline measured in this run"
        )
    header = (
        f"{'tokens':>7} {'on disk':>10} {'restore':>9} {'llama.cpp':>10} {'÷llama':>6} "
        f"{'blob':>8} {'RAM':>7} {'resumed':>9} {'hot':>7} {'re-read':>10} "
        f"{'sooner':>7} {'best':>6} {'reached':>8}"
    )
    lines += ["", header, "-" * len(header)]
    for r in report.rows:
        lines.append(
            f"{r.tokens:>7,} {r.snapshot_bytes / mib:>6.1f} MiB {r.restore_ms:>6.1f} ms "
            f"{r.limit_ms:>7.1f} ms {r.restore_over_limit:>5.2f}× {r.restore_blob_ms:>5.1f} ms "
            f"{r.restore_ram_ms:>4.1f} ms {r.ttft_resume_ms:>6.0f} ms {r.ttft_hot_ms:>4.0f} ms "
            f"{r.ttft_prefill_ms:>7.0f} ms {r.speedup:>6.0f}× {r.limit_speedup:>5.0f}× "
            f"{r.speedup_of_limit:>8.0%}"
        )
    lines += column_notes(RESUME_COLUMNS)
    if len({lr.flash_attn for lr in report.layouts}) > 1 or report.layouts_note:
        lines += ["", "chunk restores in both V layouts (llama.cpp = its own loader, same state):"]
        for lr in sorted(report.layouts, key=lambda r: (r.tokens, not r.flash_attn)):
            kind = (
                "flash attention on (V rows)"
                if lr.flash_attn
                else "flash attention off (V transposed)"
            )
            lines.append(
                f"{lr.tokens:>7,}  {kind:<35} restore {lr.restore_ms:>6.1f} ms, llama.cpp "
                f"{lr.limit_ms:>6.1f} ms: {lr.restore_over_limit:.2f}× (blob "
                f"{lr.restore_blob_ms:.1f} ms: {lr.blob_over_limit:.2f}×)"
            )
        if report.layouts_note:
            lines.append(f"  {report.layouts_note}")
    if report.writes:
        lines += [
            "",
            f"{'turn':>4} {'history':>8} {'new':>5} {'written':>10} {'new KV':>10} "
            f"{'ratio':>6} {'whole':>11}",
        ]
        for w in report.writes:
            lines.append(
                f"{w.turn:>4} {w.history_tokens:>8,} {w.new_tokens:>5} "
                f"{w.written_bytes / mib:>6.2f} MiB {w.new_kv_bytes / mib:>6.2f} MiB "
                f"{w.written_over_new:>5.2f}× {w.blob_bytes / mib:>7.2f} MiB"
            )
        lines += column_notes(WRITE_COLUMNS)
    if report.threads.get("speeds"):
        lines += ["", threads_line(report.threads)]
    if report.forks:
        f = report.forks
        lines += [
            "",
            f"{f['forks']} forks of {f['prefix_tokens']:,} tokens: {f['disk_bytes'] / mib:.1f} MiB "
            f"on disk = {f['disk_over_ideal']:.2f}× (prefix + branches), "
            f"{f['disk_over_blobs']:.2f}× of whole blobs ({f['whole_blob_bytes'] / mib:.1f} MiB)",
        ]
    return "\n".join(lines)


WRITE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("turn", "one turn of a conversation that grows"),
    ("history", "its length in tokens after the turn"),
    ("new", "tokens the turn added (message and reply)"),
    ("written", "bytes kvchat wrote for the turn's snapshot"),
    ("new KV", "the KV bytes of the new tokens alone: the least any save can write"),
    ("ratio", "written ÷ new KV: 1.00× writes nothing twice"),
    ("whole", "what saving the whole state (llama.cpp's way) would write that turn"),
)


def threads_line(threads: dict[str, Any]) -> str:
    """E.g. "threads: 1 (as measured at start) vs 2 (physical cores): generation 126 vs 27
    tok/s (4.77×), prompts 156 vs 124 tok/s (1.26×)"."""
    speeds = threads["speeds"]
    chosen, physical = str(threads["chosen"]), str(threads["physical"])
    if chosen == physical:
        row = speeds[chosen]
        return (
            f"threads: {chosen} (as measured at start; the physical cores too): generation "
            f"{row['generate']:.0f} tok/s, prompts {row['prefill']:.0f} tok/s"
        )
    parts = []
    for kind, label in (("generate", "generation"), ("prefill", "prompts")):
        mine, base = speeds[chosen][kind], speeds[physical][kind]
        ratio = mine / base if base else 0.0
        parts.append(f"{label} {mine:.0f} vs {base:.0f} tok/s ({ratio:.2f}×)")
    return f"threads: {chosen} (as measured at start) vs {physical} (physical cores): " + ", ".join(
        parts
    )
