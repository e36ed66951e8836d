"""``kvchat bench``: what keeping the KV cache buys, measured against baselines in one run.

Every figure is a ratio against a baseline measured in the same run on the same loaded
model, so it holds on a noisy shared machine even when absolute times do not:

* resume vs full prefill (time to first token of a ~20-token next turn), and the limit
  of that ratio: prefill ÷ (llama.cpp's own load + the same turn with the session already
  in the context), so the speedup reads as a fraction of what physics allows;
* our restore vs llama.cpp's own ``llama_state_seq_load_file`` of the same state;
* restore from chunks vs from a whole blob, and from RAM vs from disk;
* bytes written per turn as the history grows, vs the new tokens' KV bytes;
* disk bytes for forks of one conversation, vs the shared prefix plus the branches.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.bench.progress import Reporter, plan_resume_bench
from kvchat.bench.report import (
    BenchReport,
    BenchRow,
    LayoutRow,
    WriteRow,
    format_report,
    machine,
    machine_line,
    threads_line,
)
from kvchat.config import Settings
from kvchat.engine import Engine, GenerationParams, GenerationStats
from kvchat.kvcache import SnapshotStore
from kvchat.service.chat import ChatService, open_service
from kvchat.service.context_window import system_head
from kvchat.store import SnapshotRow

__all__ = [
    "BenchReport",
    "BenchRow",
    "LayoutRow",
    "WriteRow",
    "build_history",
    "format_report",
    "machine",
    "machine_line",
    "Reporter",
    "run_bench",
]

NEXT_MESSAGE = (
    "Thanks! Now please summarise the three most important points above as one short bulleted list."
)
_WORDS = (
    "memory cache token model context layer attention window river mountain library "
    "garden engine signal theory market history music science planet ocean village "
    "bridge storm winter summer journey letter question answer reason story detail"
).split()
Say = Callable[[str], None]


def _paragraph(rng: random.Random, words: int) -> str:
    sentences = []
    while words > 0:
        n = min(words, rng.randint(8, 16))
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + ".")
        words -= n
    return " ".join(sentences)


def build_history(service: ChatService, target_tokens: int, seed: int = 7) -> str:
    """A session whose rendered history is about ``target_tokens`` long, ending on a user turn."""
    rng = random.Random(seed + target_tokens)
    session = service.sessions.new_session(title=f"bench {target_tokens}")
    engine = service.load_engine()
    chat: list[dict[str, str]] = []
    while True:
        for role in ("user", "assistant"):
            text = _paragraph(rng, 60 if role == "user" else 140)
            chat.append({"role": role, "content": text})
            service.sessions.add_message(
                session.id, role, text, token_count=engine.count_tokens(text)
            )
        if len(engine.chat_tokens(chat)) >= target_tokens - 40:
            break
    service.sessions.add_message(session.id, "user", "Go on.", token_count=2)
    return session.id


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


# Prefill speed assumed for the estimate when the start's measurement gave none (tokens/s).
FALLBACK_RATE = 300.0


def run_bench(
    settings: Settings,
    sizes: list[int],
    *,
    cold: bool = False,
    repeat: int = 5,
    tiers: bool = True,
    layouts: bool = True,
    threads: bool = True,
    write_turns: int = 12,
    forks: int = 5,
    reporter: Reporter | None = None,
) -> BenchReport:
    """Measure the thread count in use against the physical cores, then each size's resume
    against a re-read and llama.cpp's loader; then writes per turn, forks and the other V
    layout (each but the resume when asked). ``reporter`` gets the estimate (once the
    prefill speed is measured), each step and what was found."""
    out = reporter or Reporter()
    say = out.say
    report = BenchReport()
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-bench-") as scratch,
        open_service(settings, home=Path(scratch)) as service,
    ):
        engine = service.load_engine()
        report.machine = machine(engine)
        say(machine_line(report.machine))
        report.threads = _bench_threads(engine) if threads else {}
        if report.threads.get("speeds"):
            say(threads_line(report.threads))
        fitting = [t for t in sizes if t + 200 <= engine.n_ctx]
        for target in sorted(set(sizes) - set(fitting)):
            say(f"skipping {target} tokens: does not fit n_ctx={engine.n_ctx}")
        rate = _prefill_rate(report.threads)
        plan = plan_resume_bench(
            fitting,
            rate,
            repeat=repeat,
            writes=write_turns if tiers else 0,
            forks=forks if tiers else 0,
            other_layout=layouts,
        )
        report.estimate_s = plan.seconds + time.monotonic() - started
        out.begin(plan, rate)
        for target in fitting:
            out.step(f"resume-{target}")
            row, layout = _bench_resume(service, target, cold=cold, repeat=repeat, say=say)
            report.rows.append(row)
            report.layouts.append(layout)
        if tiers and write_turns:
            out.step("writes")
            report.writes = _bench_writes(service, say, turns=write_turns)
        if tiers and forks:
            out.step("forks")
            report.forks = _bench_forks(service, say, n_forks=forks)
        flash_attn = bool(report.machine.get("flash_attn"))
        type_v = str(report.machine.get("type_v", "f16"))
    if layouts:
        out.step("layout")
        other, report.layouts_note = _other_layout(
            settings, flash_attn, type_v, fitting, cold=cold, repeat=repeat, say=say
        )
        report.layouts += other
    out.finish()
    report.elapsed_s = time.monotonic() - started
    report.machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _prefill_rate(threads: dict[str, Any]) -> float:
    """Prompt tokens/s measured at the start with the threads in use, or a guess."""
    speeds = threads.get("speeds") or {}
    mine = speeds.get(str(threads.get("chosen")), {})
    rate = float(mine.get("prefill") or 0.0)
    return rate if rate > 0 else FALLBACK_RATE


def _bench_threads(engine: Engine) -> dict[str, Any]:
    """Tokens/s with the thread count in use (the probe's choice, or the setting) against
    the physical-core count, measured now, one after the other, in the same context."""
    from kvchat.config import physical_cores

    chosen, physical = engine.config.n_threads, physical_cores()
    counts = sorted({chosen, physical}, reverse=True)
    speeds = engine.measure_threads(counts, prompt=128, generate=32)
    return {"chosen": chosen, "physical": physical, "speeds": speeds} if speeds else {}


@dataclass
class _Prepared:
    """A history of one length, snapshotted three ways: our chunks (the session's own
    snapshot), llama.cpp's own state file, and our whole blob (a twin session's)."""

    session_id: str
    row: SnapshotRow
    limit_path: Path
    blobs: SnapshotStore
    twin_id: str
    files: list[Path]


def _prepare(service: ChatService, target: int, say: Say) -> _Prepared:
    engine = service.load_engine()
    tiers = service.host.tiers
    fingerprint = tiers.fingerprint
    assert fingerprint is not None
    session_id = build_history(service, target)
    say(f"{target}: prefilling the history to make its snapshot…")
    service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
    row = tiers.snapshot(session_id)
    if row is None:
        raise RuntimeError("bench: the history's snapshot was not written")
    service.make_hot(session_id)
    directory = tiers.cold.directory
    limit_path = directory / f"limit-{target}.llama"
    engine.state_save_file(limit_path)
    twin = service.sessions.new_session(f"bench {target} blob twin")
    blobs = SnapshotStore(directory, tiers.store, chunked=False)
    blob_row = blobs.save(twin.id, engine, fingerprint).row
    tiers.mark_hot(None)
    files = [*tiers.cold.files(row), limit_path, *blobs.files(blob_row)]
    return _Prepared(session_id, row, limit_path, blobs, twin.id, files)


def _restores(
    service: ChatService, prep: _Prepared, *, cold: bool, repeat: int
) -> tuple[float, float, float]:
    """Medians of (our chunk restore, llama.cpp's loader, our blob restore) in ms, taken in
    turns so that a change in the machine's load hits all three alike. Ours are the times
    the restore reports (validate, read, verify, load), as a turn shows them."""
    engine = service.load_engine()
    tiers = service.host.tiers
    fingerprint = tiers.fingerprint
    assert fingerprint is not None
    ours: list[float] = []
    limits: list[float] = []
    blobs: list[float] = []
    for _ in range(repeat):
        _page_cache(prep.files, cold)
        started = time.perf_counter()
        engine.state_load_file(prep.limit_path)
        limits.append((time.perf_counter() - started) * 1000)
        _page_cache(prep.files, cold)
        result = tiers.cold.restore(prep.session_id, engine, fingerprint)
        if result.source != "disk":
            raise RuntimeError(f"bench restore failed: {result.reason}")
        ours.append(result.ms)
        _page_cache(prep.files, cold)
        result = prep.blobs.restore(prep.twin_id, engine, fingerprint)
        if result.source != "disk":
            raise RuntimeError(f"bench blob restore failed: {result.reason}")
        blobs.append(result.ms)
    tiers.mark_hot(None)
    engine.clear()
    return statistics.median(ours), statistics.median(limits), statistics.median(blobs)


def _page_cache(files: list[Path], cold: bool) -> None:
    for path in files:
        (_evict if cold else _warm)(path)


def _layout_row(target: int, flash_attn: bool, restores: tuple[float, float, float]) -> LayoutRow:
    ours, limit, blob = restores
    return LayoutRow(
        tokens=target,
        flash_attn=flash_attn,
        restore_ms=ours,
        limit_ms=limit,
        restore_over_limit=ours / limit if limit else float("inf"),
        restore_blob_ms=blob,
        blob_over_limit=blob / limit if limit else float("inf"),
    )


def _bench_resume(
    service: ChatService, target: int, *, cold: bool, repeat: int, say: Say
) -> tuple[BenchRow, LayoutRow]:
    """One history length: restores (ours, llama.cpp's, blob, RAM) and TTFT vs full prefill
    and vs the same turn with the session already in the context.

    The measurements drive the KV tiers the service composes (``service.host.tiers``): the
    hot session is forgotten between restores so that each one reads its tier again.
    """
    engine = service.load_engine()
    tiers = service.host.tiers
    prep = _prepare(service, target, say)
    session_id, row = prep.session_id, prep.row
    restore, limit, blob = _restores(service, prep, cold=cold, repeat=repeat)

    resume_ttft: list[float] = []
    hot_ttft: list[float] = []
    decoded_resume = 0
    for _ in range(repeat):
        _page_cache(prep.files, cold)
        probe = service.turns.probe(session_id, NEXT_MESSAGE)
        if probe.restore.source != "disk":
            raise RuntimeError(f"bench restore failed: {probe.restore.reason}")
        resume_ttft.append(probe.ttft_ms or 0.0)
        decoded_resume = probe.tokens.decoded
        # Interleaved with the resumes, so that a change in the machine's load hits both.
        hot_ttft.append(_hot_ttft_ms(service, session_id))

    service.make_hot(session_id)
    tiers.spill()  # into the RAM tier; the context holds no session now
    ram_times = []
    for _ in range(repeat):
        tiers.mark_hot(None)
        result = service.make_hot(session_id)
        if result.source != "ram":
            raise RuntimeError("bench RAM restore failed")
        ram_times.append(result.ms)
    tiers.mark_hot(None)
    tiers.warm.clear()
    engine.clear()

    say(f"{target}: full prefill for the baseline…")
    baseline = service.turns.probe(session_id, NEXT_MESSAGE, no_restore=True)
    prep.limit_path.unlink(missing_ok=True)
    ttft_resume = statistics.median(resume_ttft)
    ttft_hot = statistics.median(hot_ttft)
    ttft_prefill = baseline.ttft_ms or 0.0
    speedup = ttft_prefill / ttft_resume if ttft_resume else float("inf")
    limit_speedup = ttft_prefill / (limit + ttft_hot) if limit + ttft_hot else float("inf")
    result_row = BenchRow(
        tokens=row.n_tokens,
        snapshot_bytes=row.n_bytes,
        restore_ms=restore,
        limit_ms=limit,
        restore_over_limit=restore / limit if limit else float("inf"),
        ttft_resume_ms=ttft_resume,
        ttft_prefill_ms=ttft_prefill,
        speedup=speedup,
        decoded_resume=decoded_resume,
        decoded_prefill=baseline.tokens.decoded,
        restore_blob_ms=blob,
        chunks_over_blob=restore / blob if blob else float("inf"),
        restore_ram_ms=statistics.median(ram_times),
        ttft_hot_ms=ttft_hot,
        limit_speedup=limit_speedup,
        speedup_of_limit=speedup / limit_speedup if limit_speedup else 0.0,
    )
    say(
        f"{target}: restore {restore:.1f} ms (llama.cpp {limit:.1f} ms, blob {blob:.1f} ms, "
        f"RAM {result_row.restore_ram_ms:.1f} ms), TTFT {ttft_resume:.0f} ms vs "
        f"{ttft_prefill:.0f} ms → {speedup:.0f}× (hot turn {ttft_hot:.0f} ms: limit "
        f"{limit_speedup:.0f}×, {result_row.speedup_of_limit:.0%} of it)"
    )
    flash_attn = engine.config.flash_attn
    return result_row, _layout_row(row.n_tokens, flash_attn, (restore, limit, blob))


def _other_layout(
    settings: Settings,
    flash_attn: bool,
    type_v: str,
    sizes: list[int],
    *,
    cold: bool,
    repeat: int,
    say: Say,
) -> tuple[list[LayoutRow], str | None]:
    """Chunk restores with flash attention the other way (the other V layout), on a second
    load of the model: rows, or none and why."""
    other = not flash_attn
    if not other and type_v != "f16":
        return [], f"flash attention off needs an f16 V cache (this run's is {type_v})"
    rows: list[LayoutRow] = []
    changed = settings.model_copy(update={"flash_attn": other})
    say(f"the other V layout: flash attention {'on' if other else 'off'}…")
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-bench-") as scratch,
        open_service(changed, home=Path(scratch)) as service,
    ):
        engine = service.load_engine()
        for target in sizes:
            if target + 200 > engine.n_ctx:
                continue
            prep = _prepare(service, target, say)
            restores = _restores(service, prep, cold=cold, repeat=repeat)
            prep.limit_path.unlink(missing_ok=True)
            rows.append(_layout_row(prep.row.n_tokens, other, restores))
            say(
                f"{target}: flash attention {'on' if other else 'off'}: restore "
                f"{restores[0]:.1f} ms, llama.cpp {restores[1]:.1f} ms"
            )
    return rows, None


def _hot_ttft_ms(service: ChatService, session_id: str) -> float:
    """TTFT of the probe's message with the session already in the context: its KV is
    restored first (untimed), then only the new turn is timed, as ``probe_turn`` times it."""
    tiers = service.host.tiers
    tiers.mark_hot(None)
    restored = service.make_hot(session_id)
    if restored.source not in ("disk", "ram"):
        raise RuntimeError(f"bench restore failed: {restored.reason}")
    engine = service.engine
    session = service.store.get_session(session_id)
    stats = GenerationStats()  # the clock starts here, as a turn's does
    chat = [m.as_chat() for m in service.sessions.messages(session_id)]
    head = system_head(session.system_prompt or service.host.settings.system_prompt)
    prompt = engine.chat_tokens(head + chat + [{"role": "user", "content": NEXT_MESSAGE}])
    engine.prefill(prompt)
    "".join(engine.generate(GenerationParams(temperature=0.0, max_tokens=1), stats))
    tiers.mark_hot(None)  # the context holds the probe now, not the session
    return stats.ttft_ms or 0.0


def _bench_writes(service: ChatService, say: Say, turns: int = 12) -> list[WriteRow]:
    """Bytes each turn writes as one conversation grows, vs the KV of its new tokens."""
    say(f"writes: {turns} turns of one conversation…")
    rng = random.Random(11)
    session = service.sessions.new_session(title="bench writes")
    rows: list[WriteRow] = []
    before = 0
    for turn in range(1, turns + 1):
        report = service.send(session.id, _paragraph(rng, 90), max_tokens=48, temperature=0.0)
        tokens = service.context_tokens
        per_token = report.snapshot.bytes / tokens
        new_tokens = tokens - before
        new_kv = int(new_tokens * per_token)
        rows.append(
            WriteRow(
                turn=turn,
                history_tokens=tokens,
                new_tokens=new_tokens,
                written_bytes=report.snapshot.written,
                new_kv_bytes=new_kv,
                written_over_new=report.snapshot.written / new_kv if new_kv else 0.0,
                blob_bytes=report.snapshot.bytes,
            )
        )
        before = tokens
    return rows


def _bench_forks(service: ChatService, say: Say, n_forks: int = 5) -> dict[str, Any]:
    """Disk bytes for forks of one long conversation, each continued by one turn."""
    say(f"forks: {n_forks} branches of a ~2k-token conversation…")
    service.host.kv().clear()
    parent = build_history(service, 2048, seed=3)
    service.regenerate(parent, max_tokens=24, temperature=0.0)
    prefix = service.host.tiers.snapshot(parent)
    assert prefix is not None
    branch_bytes = 0
    for index in range(n_forks):
        child = service.sessions.fork(parent)
        report = service.send(
            child.id, f"Branch {index}: {NEXT_MESSAGE}", max_tokens=24, temperature=0.0
        )
        branch_bytes += report.snapshot.bytes - prefix.n_bytes
    disk = service.host.kv().stats()["disk"]
    on_disk, logical = disk["bytes"], disk["logical_bytes"]
    ideal = prefix.n_bytes + branch_bytes
    return {
        "forks": n_forks,
        "prefix_tokens": prefix.n_tokens,
        "prefix_bytes": prefix.n_bytes,
        "branch_bytes": branch_bytes,
        "disk_bytes": on_disk,
        "whole_blob_bytes": logical,
        "disk_over_ideal": on_disk / ideal,
        "disk_over_blobs": on_disk / logical,
    }
