"""Every kvchat command whose reader stops early (`kvchat … | head -1`) ends quietly, exit 0:
the reader has what it wanted (`kvchat: Broken pipe` and exit 2 were printed before)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env


@pytest.mark.parametrize("args", [["doctor"], ["models", "list"], ["config"]], ids=" ".join)
def test_a_reader_that_stops_early_ends_kvchat_quietly(kvhome: Path, args) -> None:
    # `true` reads nothing and is gone before kvchat writes: every write meets a closed pipe.
    shell = f"{sys.executable} -m kvchat {' '.join(args)} | true"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", shell],
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(kvhome)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr
