"""``kvchat bench``: resume vs full prefill, and our restore vs llama.cpp's own loader.

Every figure is measured in the same run on the same loaded model, so the ratios hold
on a noisy shared machine even when the absolute times do not.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from app.chat import ChatService
from app.config import Settings

NEXT_MESSAGE = "Thanks! Now please summarise the three most important points above as one short bulleted list."
_WORDS = (
    "memory cache token model context layer attention window river mountain library "
    "garden engine signal theory market history music science planet ocean village "
    "bridge storm winter summer journey letter question answer reason story detail"
).split()


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

    def to_json(self) -> dict[str, float | int]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _paragraph(rng: random.Random, words: int) -> str:
    sentences = []
    while words > 0:
        n = min(words, rng.randint(8, 16))
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(sentence.capitalize() + ".")
        words -= n
    return " ".join(sentences)


def build_history(service: ChatService, target_tokens: int, seed: int = 7) -> str:
    """A session whose rendered history is about ``target_tokens`` long, ending on a user turn."""
    rng = random.Random(seed + target_tokens)
    session = service.new_session(title=f"bench {target_tokens}")
    engine = service.engine
    chat: list[dict[str, str]] = []
    while True:
        for role in ("user", "assistant"):
            text = _paragraph(rng, 60 if role == "user" else 140)
            chat.append({"role": role, "content": text})
            service.store.add_message(session.id, role, text, token_count=engine.count_tokens(text))
        if len(engine.chat_tokens(chat)) >= target_tokens - 40:
            break
    service.store.add_message(session.id, "user", "Go on.", token_count=2)
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
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    say = progress or (lambda _line: None)
    rows: list[BenchRow] = []
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as scratch:
        service = ChatService(settings, home=Path(scratch))
        try:
            engine = service.load_engine()
            say(f"model {engine.model_name}, n_ctx {engine.n_ctx}, threads {settings.n_threads}")
            for target in sizes:
                if target + 200 > engine.n_ctx:
                    say(f"skipping {target} tokens: does not fit n_ctx={engine.n_ctx}")
                    continue
                rows.append(_bench_one(service, target, cold=cold, repeat=repeat, say=say))
        finally:
            service.close()
    return rows


def _bench_one(
    service: ChatService, target: int, *, cold: bool, repeat: int, say: Callable[[str], None]
) -> BenchRow:
    engine = service.engine
    session_id = build_history(service, target)
    say(f"{target}: prefilling the history to make its snapshot…")
    service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
    row = service.store.get_snapshot(session_id)
    assert row is not None
    snapshot_path = service.snapshots.directory / row.path

    # llama.cpp's own file of the same state: load it once so the context holds it, save.
    limit_path = Path(service.snapshots.directory) / f"limit-{target}.llama"
    service.make_hot(session_id)
    engine.state_save_file(limit_path)
    service.hot_session_id = None

    restore_ms: list[float] = []
    resume_ttft: list[float] = []
    limit_ms: list[float] = []
    decoded_resume = 0
    for _ in range(repeat):
        for path in (snapshot_path, limit_path):
            (_evict if cold else _warm)(path)
        report = service.probe_turn(session_id, NEXT_MESSAGE)
        if report.restore.source != "disk":
            raise RuntimeError(f"bench restore failed: {report.restore.reason}")
        restore_ms.append(report.restore.ms)
        resume_ttft.append(report.ttft_ms or 0.0)
        decoded_resume = report.tokens.decoded
        for path in (snapshot_path, limit_path):
            (_evict if cold else _warm)(path)
        started = time.perf_counter()
        engine.state_load_file(limit_path)
        limit_ms.append((time.perf_counter() - started) * 1000)
        engine.clear()

    say(f"{target}: full prefill for the baseline…")
    baseline = service.probe_turn(session_id, NEXT_MESSAGE, no_restore=True)
    limit_path.unlink(missing_ok=True)
    restore = statistics.median(restore_ms)
    limit = statistics.median(limit_ms)
    ttft_resume = statistics.median(resume_ttft)
    ttft_prefill = baseline.ttft_ms or 0.0
    result = BenchRow(
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
    )
    say(
        f"{target}: restore {restore:.1f} ms (llama.cpp {limit:.1f} ms), "
        f"TTFT {ttft_resume:.0f} ms vs {ttft_prefill:.0f} ms → {result.speedup:.0f}×"
    )
    return result


def format_table(rows: list[BenchRow]) -> str:
    header = (
        f"{'tokens':>7} {'snapshot':>10} {'restore':>9} {'llama.cpp':>10} {'ratio':>6} "
        f"{'TTFT resume':>12} {'TTFT prefill':>13} {'speedup':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.tokens:>7,} {r.snapshot_bytes / 2**20:>7.1f} MiB {r.restore_ms:>6.1f} ms "
            f"{r.limit_ms:>7.1f} ms {r.restore_over_limit:>5.2f}× {r.ttft_resume_ms:>9.0f} ms "
            f"{r.ttft_prefill_ms:>10.0f} ms {r.speedup:>7.0f}×"
        )
    lines.append(
        "restore = validate + map + checksum + llama_state_seq_set_data of our snapshot; "
        "llama.cpp = llama_state_seq_load_file of the same state; "
        "TTFT = next ~20-token turn to its first token."
    )
    return "\n".join(lines)
