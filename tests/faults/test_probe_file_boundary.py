"""The engine probe's file is a door: whatever it holds, kvchat reads it in bounded time and
memory, never raises, never obeys a value it did not check, and shows its text as text.

The probe file decides native code that can crash the process (weight repacking on an AMX
CPU), so a value it holds is used only when it has the exact type and range the probe writes:
``"repack": "false"``, ``1``, a thread count of 100,000 or ``"n_gpu_layers": "all"`` drop the
entry (its combination is probed again). The campaign mutates a real file at random; a sample
runs by default, ``pytest -m stress`` runs all of it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvchat.engine.probe import (
    AMX_NOT_RUN,
    ProbeOutcome,
    Trial,
    has_amx,
    machine_facts,
    probe_key,
    probe_words,
)
from kvchat.engine.probe_book import (
    MAX_FILE_BYTES,
    MAX_SPEED,
    MAX_THREADS,
    ProbeBook,
    parse_outcomes,
)
from kvchat.paths import bundled_model_path
from tests.conftest import FAST, REPO, clean_env, run_cli

ESC = "\x1b"
KEY = "0123456789abcdef01234567"


def good_entry(key: str = KEY, **changes: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "key": key,
        "trial": {"repack": False, "flash_attn": False, "n_gpu_layers": -1},
        "wanted": {"repack": True, "flash_attn": False, "n_gpu_layers": -1},
        "failures": ["weight repacking on: killed by SIGSEGV"],
        "speeds": {"1": {"prefill": 120.5, "generate": 20.1}, "2": {"prefill": 210.0}},
        "probe_ms": 5123.0,
        "when": "2026-12-01T10:00:00+00:00",
        "amx": True,
        "recheck": "",
        "model_bytes": 94_000_000,
        "model_name": "SmolLM2",
    }
    entry.update(changes)
    return entry


def file_of(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"version": 1, "outcomes": {e["key"]: e for e in entries}}).encode()


def check_read(path: Path) -> list[ProbeOutcome]:
    """Read ``path`` as kvchat does and check every value that comes out."""
    started = time.monotonic()
    outcomes = [ProbeOutcome.from_record(r) for r in ProbeBook(path).records()]
    assert time.monotonic() - started < 2.0
    for outcome in outcomes:
        for trial in (outcome.trial, outcome.wanted):
            assert type(trial.repack) is bool and type(trial.flash_attn) is bool
            assert type(trial.n_gpu_layers) is int and -1 <= trial.n_gpu_layers <= 4096
        for n, row in outcome.speeds.items():
            assert 1 <= int(n) <= MAX_THREADS
            assert all(0.0 <= v <= MAX_SPEED for v in row.values())
        shown = probe_words(outcome) + (outcome.threads_line() or "")
        shown += " ".join(outcome.failures) + outcome.model_name + outcome.when
        assert ESC not in shown and "\x9b" not in shown and "\x07" not in shown
    return outcomes


# --- each failure the issue names ------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"trial": {"repack": "false", "flash_attn": False, "n_gpu_layers": -1}},
        {"trial": {"repack": 1, "flash_attn": False, "n_gpu_layers": -1}},
        {"trial": {"repack": False, "flash_attn": False, "n_gpu_layers": "all"}},
        {"trial": {"repack": False, "flash_attn": False, "n_gpu_layers": 10**12}},
        {"speeds": {"100000": {"generate": 5.0}}},
        {"speeds": {"2": {"generate": "abc"}}},
        {"speeds": {"2": {"generate": -1.0}}},
        {"probe_ms": "abc"},
        {"trial": "repack on"},
        {"key": "../../etc/passwd"},
    ],
)
def test_a_value_of_the_wrong_type_or_range_drops_its_entry(tmp_path: Path, changes) -> None:
    path = tmp_path / "probe.json"
    path.write_bytes(file_of(good_entry(**changes), good_entry("f" * 24)))
    (kept,) = check_read(path)
    assert kept.key == "f" * 24


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_speed_that_is_not_finite_drops_its_entry(tmp_path: Path, literal: str) -> None:
    path = tmp_path / "probe.json"
    raw = file_of(good_entry()).replace(b"120.5", literal.encode())
    path.write_bytes(raw)
    assert check_read(path) == []


def test_text_in_the_file_reaches_the_terminal_as_text(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    hostile = f"{ESC}]52;c;cm0gLXJmIH4={ESC}\\{ESC}[2J{ESC}[31mred\x9b1m\x07"
    path.write_bytes(file_of(good_entry(failures=[hostile], model_name=hostile)))
    (outcome,) = check_read(path)
    assert "red" in outcome.failures[0]


def test_deep_nesting_and_a_large_file_are_refused_in_bounded_time(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    path.write_bytes(b"[" * 200_000)
    assert check_read(path) == []
    path.write_bytes(b'{"outcomes": {"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}}")
    assert check_read(path) == []
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1) + file_of(good_entry()))
    assert check_read(path) == []


def test_two_thousand_entries_read_in_one_pass(tmp_path: Path) -> None:
    """11cd244 parsed the whole file again for each entry: 2,000 entries took 75 s."""
    path = tmp_path / "probe.json"
    entries = [good_entry(f"{i:024x}") for i in range(2000)]
    path.write_bytes(file_of(*entries))
    started = time.monotonic()
    assert len(check_read(path)) == 256  # read once; no more entries than a file keeps
    assert time.monotonic() - started < 2.0
    ProbeBook(path).put(
        ProbeOutcome.from_record(parse_outcomes(file_of(good_entry()))[KEY]).to_record()
    )
    assert len(ProbeBook(path).records()) <= 64  # a write keeps the newest


def test_a_fifo_a_device_link_or_a_folder_at_its_path_is_no_file(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    os.mkfifo(path)
    assert check_read(path) == []  # would block for ever on open() without O_NONBLOCK
    path.unlink()
    path.symlink_to("/dev/zero")
    assert check_read(path) == []
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(file_of(good_entry()))
    path.symlink_to(target)
    assert check_read(path) == []  # never through a link
    path.unlink()
    path.mkdir()
    assert check_read(path) == []


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["types", "fifo", "nesting"])
def test_doctor_and_config_say_one_line_whatever_the_file_holds(
    tmp_path: Path, kvhome: Path, damage: str
) -> None:
    """11cd244: AttributeError and ValueError tracebacks from doctor, a FIFO blocking it."""
    path = tmp_path / "probe.json"
    if damage == "fifo":
        os.mkfifo(path)
    elif damage == "nesting":
        path.write_bytes(b"[" * 200_000)
    else:
        path.write_bytes(file_of(good_entry(trial="abc", speeds={"x": 1}), good_entry("a" * 24)))
    env = {"KVCHAT_PROBE_FILE": str(path)}
    doctor = run_cli(kvhome, "doctor", env=env, check=False)
    assert "Traceback" not in doctor.stderr and doctor.returncode in (0, 1), doctor.stderr


# --- verdicts the probe did not give, or that crashed -------------------------------------------


def _bundled() -> Path:
    path = bundled_model_path()
    assert path is not None
    return path


@pytest.mark.stress  # two probes and a crash; e2e/engine/test_probe.py's repack crash test runs by default
@pytest.mark.e2e
def test_a_forged_repack_verdict_that_crashes_is_withdrawn_and_probed_again(
    tmp_path: Path, kvhome: Path
) -> None:
    """A file (stale, shared or forged) says repacking is safe here. The run on it dies by a
    native crash (the test sends the SIGSEGV llama.cpp would); the next start withdraws the
    verdict and probes again from it, and the child that crashes with repacking on turns it
    off. On an AMX CPU the forged verdict is not even used ("auto" never repacks there).
    On 11cd244 every run crashed on such a CPU."""
    path = tmp_path / "probe.json"
    wanted = Trial(repack=True, flash_attn=False, n_gpu_layers=-1)
    key = probe_key(machine_facts(_bundled()), wanted)
    forged = good_entry(key, trial={"repack": True, "flash_attn": False, "n_gpu_layers": -1})
    forged["wanted"] = dict(forged["trial"])
    forged["failures"] = []
    path.write_bytes(file_of(forged))
    env = {**clean_env(), "KVCHAT_HOME": str(kvhome), "KVCHAT_PROBE_FILE": str(path)}
    argv = [sys.executable, "-m", "kvchat", "ask", "--new", "Write a long essay about Rome."]
    proc = subprocess.Popen(
        [*argv, "--temperature", "0", "--max-tokens", "1000", "--threads", "1"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and not list(tmp_path.glob("probe.json.use-*")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if proc.poll() is None:
            time.sleep(1.0)  # into the reply (where the crash is on an AMX CPU)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGSEGV)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGSEGV
    crashing = {"KVCHAT_PROBE_FILE": str(path), "KVCHAT_TEST_PROBE_CRASH": "repack"}
    after = run_cli(kvhome, "ask", "--new", "Hi", *FAST, env=crashing)
    assert after.stdout.strip()
    (record,) = ProbeBook(path).records()
    assert record.trial.repack is False and not record.withdrawn
    if has_amx():  # "auto" never runs a repacking verdict there: the crash was repacking off's
        assert record.failures == [
            f"weight repacking on: {AMX_NOT_RUN}",
            "weight repacking off: crashed in use",
        ]
    else:
        assert record.failures == [
            "weight repacking on: crashed in use",
            "weight repacking on: killed by SIGSEGV",
        ]


@pytest.mark.e2e
def test_a_probe_past_its_limit_leaves_repacking_off_and_dies_with_kvchat(
    tmp_path: Path, kvhome: Path
) -> None:
    """11cd244: past the probe's limit the options stayed as asked (repacking on: SIGSEGV on
    an AMX CPU), the limit was fixed at 300 s, and a killed kvchat left probe_child running."""
    path = tmp_path / "probe.json"
    env = {"KVCHAT_PROBE_FILE": str(path), "KVCHAT_PROBE_TIMEOUT_S": "1"}
    config = run_cli(kvhome, "config", "--json", env=env).json
    assert config["settings"]["repack"]["value"] == "off"
    assert config["probe"]["words"].startswith("not judged (the test run took over 1 s")
    # A kvchat killed while its probe runs takes the probe with it.
    full = {**clean_env(), "KVCHAT_HOME": str(kvhome), "KVCHAT_PROBE_FILE": str(path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "config"],
        cwd=REPO,
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    child = _wait_for_probe_child(proc.pid)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "probe_child outlived the kvchat that started it"


def _wait_for_probe_child(parent: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")), "")
            if b"kvchat.engine.probe_child" in cmdline and ppid == str(parent):
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError("no probe_child started")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


# --- the campaign ------------------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    1,
    -1,
    0,
    10**30,
    -(10**30),
    1.5,
    "false",
    "true",
    "all",
    "",
    "x" * 100_000,
    f"{ESC}[2J{ESC}]0;pwned\x07",
    "\ud800",
    [],
    [1, 2, 3],
    {},
    {"repack": True},
    [[[[[[[[[[[]]]]]]]]]]],
]
RAW_HOSTILE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[" * 5000, "\x00"]


def _mutate(rng: random.Random) -> bytes:
    entries = [good_entry(f"{i:024x}") for i in range(rng.randint(1, 4))]
    for _ in range(rng.randint(1, 4)):
        entry = rng.choice(entries)
        target: Any = entry
        path = [rng.choice(list(target))]
        while isinstance(target[path[-1]], dict) and target[path[-1]] and rng.random() < 0.6:
            target = target[path[-1]]
            path.append(rng.choice(list(target)))
        target[path[-1]] = rng.choice(HOSTILE_VALUES)
    outcomes = {
        e["key"] if isinstance(e["key"], str) else f"k{i}": e for i, e in enumerate(entries)
    }
    raw = json.dumps({"version": 1, "outcomes": outcomes}).encode("utf-8", "surrogatepass")
    if rng.random() < 0.3:  # a literal JSON has no way to say
        raw = raw.replace(b"20.1", rng.choice(RAW_HOSTILE).encode(), 1)
    if rng.random() < 0.15:  # cut anywhere
        raw = raw[: rng.randrange(len(raw))]
    if rng.random() < 0.1:
        at = rng.randrange(len(raw))
        raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1 :]
    return raw


def _campaign(tmp_path: Path, cases: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    path = tmp_path / "probe.json"
    kept = 0
    for _ in range(cases):
        path.write_bytes(_mutate(rng))
        kept += len(check_read(path))
    return cases, kept


def test_campaign_sample(tmp_path: Path) -> None:
    cases, kept = _campaign(tmp_path, 40, seed=1)
    assert cases == 40 and kept > 0  # good entries beside damaged ones are still read


@pytest.mark.stress
def test_stress_campaign(tmp_path: Path) -> None:
    cases, kept = _campaign(tmp_path, 2000, seed=2)
    print(f"\nSTRESS probe file: {cases} hostile files read, {kept} entries kept, 0 failures")
