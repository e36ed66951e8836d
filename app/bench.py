"""``kvchat bench``: what keeping the KV cache buys, measured against baselines in one run.

Every figure is a ratio against a baseline measured in the same run on the same loaded
model, so it holds on a noisy shared machine even when absolute times do not:

* resume vs full prefill (time to first token of a ~20-token next turn);
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.chat import ChatService, open_service
from kvchat.config import Settings
from kvchat.kvcache import SnapshotStore

NEXT_MESSAGE = (
    "Thanks! Now please summarise the three most important points above as one short bulleted list."
)
_WORDS = (
    "memory cache token model context layer attention window river mountain library "
    "garden engine signal theory market history music science planet ocean village "
    "bridge storm winter summer journey letter question answer reason story detail"
).split()
Say = Callable[[str], None]


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
class BenchReport:
    rows: list[BenchRow] = field(default_factory=list)
    writes: list[WriteRow] = field(default_factory=list)
    forks: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [r.to_json() for r in self.rows],
            "writes": [w.to_json() for w in self.writes],
            "forks": _rounded(self.forks),
        }


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
    session = service.new_session(title=f"bench {target_tokens}")
    engine = service.load_engine()
    chat: list[dict[str, str]] = []
    while True:
        for role in ("user", "assistant"):
            text = _paragraph(rng, 60 if role == "user" else 140)
            chat.append({"role": role, "content": text})
            service.add_message(session.id, role, text, token_count=engine.count_tokens(text))
        if len(engine.chat_tokens(chat)) >= target_tokens - 40:
            break
    service.add_message(session.id, "user", "Go on.", token_count=2)
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


def run_bench(
    settings: Settings,
    sizes: list[int],
    *,
    cold: bool = False,
    repeat: int = 5,
    tiers: bool = True,
    progress: Say | None = None,
) -> BenchReport:
    say = progress or (lambda _line: None)
    report = BenchReport()
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-bench-") as scratch,
        open_service(settings, home=Path(scratch)) as service,
    ):
        engine = service.load_engine()
        say(f"model {engine.model_name}, n_ctx {engine.n_ctx}, threads {settings.n_threads}")
        for target in sizes:
            if target + 200 > engine.n_ctx:
                say(f"skipping {target} tokens: does not fit n_ctx={engine.n_ctx}")
                continue
            report.rows.append(_bench_resume(service, target, cold=cold, repeat=repeat, say=say))
        if tiers:
            report.writes = _bench_writes(service, say)
            report.forks = _bench_forks(service, say)
    return report


def _median_ms(action: Callable[[], Any], repeat: int, before: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _bench_resume(
    service: ChatService, target: int, *, cold: bool, repeat: int, say: Say
) -> BenchRow:
    """One history length: restores (ours, llama.cpp's, blob, RAM) and TTFT vs full prefill.

    The measurements drive the KV tiers the service composes (``service.tiers``): the
    hot session is forgotten between restores so that each one reads its tier again.
    """
    engine = service.load_engine()
    tiers = service.tiers
    fingerprint = tiers.fingerprint
    assert fingerprint is not None
    session_id = build_history(service, target)
    say(f"{target}: prefilling the history to make its snapshot…")
    service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
    row = tiers.snapshot(session_id)
    assert row is not None

    # The same state as llama.cpp's own file and as our whole-blob file.
    service.make_hot(session_id)
    directory = tiers.cold.directory
    limit_path = directory / f"limit-{target}.llama"
    engine.state_save_file(limit_path)
    twin = service.new_session(f"bench {target} blob twin")
    blobs = SnapshotStore(directory, tiers.store, chunked=False)
    blob_row = blobs.save(twin.id, engine, fingerprint).row
    tiers.mark_hot(None)
    files = [*tiers.cold.files(row), limit_path, *blobs.files(blob_row)]

    def page_cache() -> None:
        for path in files:
            (_evict if cold else _warm)(path)

    restore_ms: list[float] = []
    resume_ttft: list[float] = []
    decoded_resume = 0
    for _ in range(repeat):
        page_cache()
        probe = service.probe_turn(session_id, NEXT_MESSAGE)
        if probe.restore.source != "disk":
            raise RuntimeError(f"bench restore failed: {probe.restore.reason}")
        restore_ms.append(probe.restore.ms)
        resume_ttft.append(probe.ttft_ms or 0.0)
        decoded_resume = probe.tokens.decoded
    limit = _median_ms(lambda: engine.state_load_file(limit_path), repeat, page_cache)

    def restore_blob() -> None:
        if blobs.restore(twin.id, engine, fingerprint).source != "disk":
            raise RuntimeError("bench blob restore failed")

    blob = _median_ms(restore_blob, repeat, page_cache)
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
    baseline = service.probe_turn(session_id, NEXT_MESSAGE, no_restore=True)
    limit_path.unlink(missing_ok=True)
    restore = statistics.median(restore_ms)
    ttft_resume = statistics.median(resume_ttft)
    ttft_prefill = baseline.ttft_ms or 0.0
    result_row = BenchRow(
        tokens=row.n_tokens,
        snapshot_bytes=row.n_bytes,
        restore_ms=restore,
        limit_ms=limit,
        restore_over_limit=restore / limit if limit else float("inf"),
        ttft_resume_ms=ttft_resume,
        ttft_prefill_ms=ttft_prefill,
        speedup=ttft_prefill / ttft_resume if ttft_resume else float("inf"),
        decoded_resume=decoded_resume,
        decoded_prefill=baseline.tokens.decoded,
        restore_blob_ms=blob,
        chunks_over_blob=restore / blob if blob else float("inf"),
        restore_ram_ms=statistics.median(ram_times),
    )
    say(
        f"{target}: restore {restore:.1f} ms (llama.cpp {limit:.1f} ms, blob {blob:.1f} ms, "
        f"RAM {result_row.restore_ram_ms:.1f} ms), TTFT {ttft_resume:.0f} ms vs "
        f"{ttft_prefill:.0f} ms → {result_row.speedup:.0f}×"
    )
    return result_row


def _bench_writes(service: ChatService, say: Say, turns: int = 12) -> list[WriteRow]:
    """Bytes each turn writes as one conversation grows, vs the KV of its new tokens."""
    say(f"writes: {turns} turns of one conversation…")
    rng = random.Random(11)
    session = service.new_session(title="bench writes")
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
    service.cache_clear()
    parent = build_history(service, 2048, seed=3)
    service.regenerate(parent, max_tokens=24, temperature=0.0)
    prefix = service.tiers.snapshot(parent)
    assert prefix is not None
    branch_bytes = 0
    for index in range(n_forks):
        child = service.fork(parent)
        report = service.send(
            child.id, f"Branch {index}: {NEXT_MESSAGE}", max_tokens=24, temperature=0.0
        )
        branch_bytes += report.snapshot.bytes - prefix.n_bytes
    disk = service.cache_stats()["disk"]
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


def format_report(report: BenchReport) -> str:
    mib = 2**20
    header = (
        f"{'tokens':>7} {'snapshot':>10} {'restore':>9} {'llama.cpp':>10} {'ratio':>6} "
        f"{'blob':>8} {'RAM':>7} {'TTFT resume':>12} {'TTFT prefill':>13} {'speedup':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in report.rows:
        lines.append(
            f"{r.tokens:>7,} {r.snapshot_bytes / mib:>6.1f} MiB {r.restore_ms:>6.1f} ms "
            f"{r.limit_ms:>7.1f} ms {r.restore_over_limit:>5.2f}× {r.restore_blob_ms:>5.1f} ms "
            f"{r.restore_ram_ms:>4.1f} ms {r.ttft_resume_ms:>9.0f} ms "
            f"{r.ttft_prefill_ms:>10.0f} ms {r.speedup:>7.0f}×"
        )
    lines.append(
        "restore = validate + map + checksum + reassemble chunks + llama_state_seq_set_data; "
        "llama.cpp = llama_state_seq_load_file of the same state; blob = our whole-file "
        "snapshot; RAM = the warm tier; TTFT = next ~20-token turn to its first token."
    )
    if report.writes:
        lines += [
            "",
            f"{'turn':>4} {'history':>8} {'new':>5} {'written':>10} {'new KV':>10} "
            f"{'ratio':>6} {'whole blob':>11}",
        ]
        for w in report.writes:
            lines.append(
                f"{w.turn:>4} {w.history_tokens:>8,} {w.new_tokens:>5} "
                f"{w.written_bytes / mib:>6.2f} MiB {w.new_kv_bytes / mib:>6.2f} MiB "
                f"{w.written_over_new:>5.2f}× {w.blob_bytes / mib:>7.2f} MiB"
            )
    if report.forks:
        f = report.forks
        lines += [
            "",
            f"{f['forks']} forks of {f['prefix_tokens']:,} tokens: {f['disk_bytes'] / mib:.1f} MiB "
            f"on disk = {f['disk_over_ideal']:.2f}× (prefix + branches), "
            f"{f['disk_over_blobs']:.2f}× of whole blobs ({f['whole_blob_bytes'] / mib:.1f} MiB)",
        ]
    return "\n".join(lines)
