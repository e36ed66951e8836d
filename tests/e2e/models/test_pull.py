"""`kvchat models pull` end to end, with the real huggingface_hub client against
a local hub-shaped server (tests/hub_server.py): the file arrives and is checked against
the published sha256, a download stopped mid-file resumes where it stopped, a checksum
mismatch removes the file and says so, and a file the disk cannot hold is refused first."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env, run_cli
from tests.hub_server import HubServer

REPO_ID, FILE = "acme/tiny-GGUF", "tiny.gguf"
DATA = b"GGUF" + hashlib.sha256(b"kvchat").digest() * 60_000  # ~1.9 MB


@pytest.fixture
def hub() -> Iterator[HubServer]:
    server = HubServer({(REPO_ID, FILE): DATA})
    yield server
    server.close()


def _env(hub: HubServer, home: Path) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
    }


def _pull(home: Path, hub: HubServer, check: bool = True):
    args = ("models", "pull", "--repo", REPO_ID, "--file", FILE)
    return run_cli(home, *args, env=_env(hub, home), check=check)


def test_a_pull_arrives_checked(kvhome: Path, hub: HubServer) -> None:
    result = _pull(kvhome, hub)
    target = kvhome / "models" / FILE
    assert target.read_bytes() == DATA
    assert f"sha256 {hashlib.sha256(DATA).hexdigest()[:16]}… matches" in result.stdout
    assert not list((kvhome / "models").glob(".*.partial"))


def test_a_pull_stopped_mid_file_resumes_where_it_stopped(kvhome: Path) -> None:
    big = DATA * 3  # ~5.8 MB, sent at 1 MB/s the first time
    hub = HubServer({(REPO_ID, FILE): big})
    hub.slow_first_get = 1_000_000
    try:
        _stop_and_resume(kvhome, hub, big)
    finally:
        hub.close()


def _stop_and_resume(kvhome: Path, hub: HubServer, big: bytes) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "models", "pull", "--repo", REPO_ID, "--file", FILE],
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(kvhome), **_env(hub, kvhome)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    partial: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in kvhome.rglob(f".{FILE}.partial") if p.stat().st_size >= 1_000_000]
        if partial:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert partial, "the download never got under way"
    assert not (kvhome / "models" / FILE).exists()
    _pull(kvhome, hub)
    assert (kvhome / "models" / FILE).read_bytes() == big
    resumed = [rng for method, _, rng in hub.requests if method == "GET" and rng]
    assert resumed and int(resumed[-1].split("=")[1].rstrip("-")) >= 1_000_000


def test_a_checksum_mismatch_removes_the_file_and_says_so(kvhome: Path, hub: HubServer) -> None:
    hub.wrong_sha256 = True
    result = _pull(kvhome, hub, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "checksum mismatch" in line and "removed" in line
    assert not (kvhome / "models" / FILE).exists()


def test_a_file_the_disk_cannot_hold_is_refused_before_downloading(
    kvhome: Path, hub: HubServer
) -> None:
    hub.claimed_size = 1 << 60  # an exbibyte
    result = _pull(kvhome, hub, check=False)
    assert result.returncode == 2 and "nothing was downloaded" in result.stderr
    assert not [m for m, path, _ in hub.requests if m == "GET" and "/resolve/" in path]
    assert not os.path.exists(kvhome / "models" / FILE)


def test_a_catalog_model_is_pulled_from_its_repo_and_then_planned_from_the_file(
    kvhome: Path, tmp_path: Path
) -> None:
    from kvchat.planner.catalog import find_entry, load_catalog
    from tests.tiny_models import FAMILIES, write_tiny

    entry = find_entry("qwen2.5-1.5b", load_catalog())
    assert entry is not None and entry.hf_repo
    tiny = write_tiny(FAMILIES["qwen2"], tmp_path / "tiny.gguf").read_bytes()
    hub = HubServer({(entry.hf_repo, entry.file): tiny})
    try:
        run_cli(kvhome, "models", "pull", entry.name, env=_env(hub, kvhome))
    finally:
        hub.close()
    assert (kvhome / "models" / entry.file).read_bytes() == tiny
    # Now here: the planner reads the file (2 layers) instead of the catalog's figures.
    plan = run_cli(kvhome, "models", "plan", entry.name, "--json").json
    assert plan["model"]["n_layer"] == FAMILIES["qwen2"].n_layer
