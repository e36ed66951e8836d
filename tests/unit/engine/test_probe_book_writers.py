"""The engine probe's file keeps every outcome when processes write it at once (two kvchat,
a shared KVCHAT_PROBE_FILE, a test run's workers): each change is a read, change and write
under the file's lock. Threads stand in for processes: each write takes the lock through an
open file of its own, which flock (and filelock) tells apart within one process too."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvchat import system
from kvchat.engine.probe_book import OutcomeRecord, ProbeBook

WRITERS = 2
EACH = 30  # 60 outcomes: under the file's 64, so none is pruned


def record(n: int) -> OutcomeRecord:
    return OutcomeRecord.model_validate(
        {
            "key": f"{n:024x}",
            "trial": {"repack": False, "flash_attn": False, "n_gpu_layers": -1},
            "wanted": {"repack": False, "flash_attn": False, "n_gpu_layers": -1},
            "failures": [],
            "speeds": {},
            "probe_ms": 1.0,
            "when": f"2026-12-05T00:00:{n % 60:02d}+00:00",
            "amx": False,
            "recheck": "",
            "model_bytes": 1,
            "model_name": "tiny",
        }
    )


@pytest.mark.parametrize("platform", system.NAMES)
def test_writers_at_once_keep_every_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str
) -> None:
    monkeypatch.setattr(system, "_chosen", system.current())  # put back afterwards
    system.use(platform)
    path = tmp_path / "probe.json"
    start = threading.Barrier(WRITERS)

    def write(first: int) -> None:
        book = ProbeBook(path)
        start.wait()
        for n in range(first, first + EACH):
            book.put(record(n))

    threads = [threading.Thread(target=write, args=(w * EACH,)) for w in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = {r.key for r in ProbeBook(path).records()}
    assert kept == {f"{n:024x}" for n in range(WRITERS * EACH)}
