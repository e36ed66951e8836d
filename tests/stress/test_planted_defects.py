"""The equality checks have teeth: with a defect planted behind the
test-only switch (``KVCHAT_PLANT_DEFECT``, read by :mod:`kvchat.kvcache.defects` alone),
the key tests that compare a restored context with a full prefill fail.

The stress tests rerun each key test in a new pytest process with one defect planted and
assert it fails, and once with none planted and assert it passes; the default run checks
that the switch is off unless set, names only the known defects, and that each is
consulted in the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.kvcache.defects import ENV

REPO = Path(__file__).resolve().parents[2]
MATRIX = "tests/e2e/resume/test_restore_equals_prefill.py::test_greedy_after_a_restore_equals_a_full_prefill[{}]"
RESUME = MATRIX.format("disk-new-process-chunks")
DISK_TURNS = (
    "tests/e2e/tiers/test_tiers.py::test_each_turn_writes_only_new_chunks_and_resumes_exactly"
)
RAM_TWICE = MATRIX.format("ram-twice")
FAMILY = "tests/e2e/families/test_families.py::test_family_resumes_branches_and_equals_a_full_prefill[{}]"
WINDOWED = "tests/e2e/families/test_hybrid.py::test_sliding_window_families_resume_branch_and_equal_a_full_prefill[{}]"
REGENERATE = (
    "tests/e2e/families/test_sliding_window.py::"
    "test_a_regenerate_below_the_floor_loads_the_window_from_ram_then_disk"
)
BUNDLE = "tests/e2e/transfer/test_bundle_resume.py::test_a_bundle_resumes_in_an_empty_home_like_a_full_prefill[chunks]"

# Each defect and the key tests measured to fail with it planted. Not listed: a defect off
# a test's path (the RAM tier in a test that restores from disk in a new process, chunks and
# window pieces in the RAM tests, a stale entry in a test that spills a session only once),
# and the sliding-window regenerate with shifted-cell, which passed (there the swapped K
# rows are in Gemma 3's one full-attention layer alone).
CAUGHT_BY: dict[str, list[str]] = {
    "shifted-cell": [
        RESUME,
        DISK_TURNS,
        FAMILY.format("llama-gqa"),
        FAMILY.format("gemma3"),
        WINDOWED.format("gpt-oss"),
        BUNDLE,
    ],
    "dropped-chunk": [
        RESUME,
        DISK_TURNS,
        FAMILY.format("llama-gqa"),
        FAMILY.format("gemma3"),
        WINDOWED.format("gpt-oss"),
        REGENERATE,
        BUNDLE,
    ],
    "stale-ram": [RAM_TWICE],
    "window-piece": [
        FAMILY.format("gemma3"),
        FAMILY.format("gemma2"),
        WINDOWED.format("gpt-oss"),
        REGENERATE,
    ],
}
KEY_TESTS = sorted({test for tests in CAUGHT_BY.values() for test in tests})


# ------------------------------------------------------------------- the defects (stress)


def run_key_test(test: str, defect: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if defect is not None:
        env[ENV] = defect
    return subprocess.run(
        [sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize(
    ("defect", "test"),
    [(defect, test) for defect, tests in CAUGHT_BY.items() for test in tests],
)
def test_a_key_test_fails_with_the_defect_planted(defect: str, test: str) -> None:
    run = run_key_test(test, defect)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "1 failed" in run.stdout.splitlines()[-1], run.stdout[-3000:]
    # Failed on one of its assertions, not on an error the defect raised.
    assert re.search(r"^E\s+(AssertionError|assert )", run.stdout, re.M), run.stdout[-3000:]


@pytest.mark.parametrize("test", KEY_TESTS)
def test_a_key_test_passes_with_no_defect_planted(test: str) -> None:
    run = run_key_test(test, None)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "1 passed" in run.stdout.splitlines()[-1]
