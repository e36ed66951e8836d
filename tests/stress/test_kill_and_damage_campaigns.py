"""The fault suite at full size: kills at every point of turns, forks and gc, and damaged
snapshots and index rows by the thousand (the default run has a sample of each in
tests/e2e/durability/test_fault_suite.py)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.e2e.durability.test_fault_suite import (
    _damage_cases,
    _kill_campaign,
    pristine,
)

__all__ = ["pristine"]  # fixtures shared with the module they come from


STRESS_CASES = int(os.environ.get("KVCHAT_STRESS_CASES", "2000"))
STRESS_KILLS = int(os.environ.get("KVCHAT_STRESS_KILLS", "200"))


def test_stress_kills(tmp_path: Path):
    n = STRESS_KILLS
    outcomes = _kill_campaign(tmp_path, n_turns=n * 6 // 10, n_forks=n // 5, n_gcs=n // 5, seed=7)
    killed = sum(o.exited is None for o in outcomes)
    print(f"\nSTRESS kills: {len(outcomes)} cases, {killed} killed mid-way")


def test_stress_damage(pristine, tmp_path: Path):
    tally = _damage_cases(pristine, tmp_path, n=STRESS_CASES, seed=2)
    print(f"\nSTRESS damage: {tally}")
