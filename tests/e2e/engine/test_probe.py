"""kvchat runs on the machines people have, with the real model and real processes: a
crash with weight repacking turns it off, is remembered and said once; the setting
overrides the probe; a machine where everything crashes gets one line and keeps the
message; a segfault mid-reply (CLI or app) keeps the text and is reported on the next
start; the service opens the model on a smaller plan and says why; the thread count
follows a measurement made under load and is measured again when replies get far slower."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.config import Settings, load_settings
from kvchat.engine.api import EngineConfig, GenerationParams, GenerationStats
from kvchat.engine.probe import (
    AMX_NOT_RUN,
    ProbeBook,
    ProbeOutcome,
    has_amx,
    run_probe,
)
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path
from tests.conftest import FAST, REPO, clean_env, run_cli, run_cli_here

# The probe measures thread counts only where none is set (the run sets one: tests/conftest.py).
pytestmark = pytest.mark.usefixtures("threads_unset")

CRASH_ENV = "KVCHAT_TEST_PROBE_CRASH"
# A message whose greedy reply runs to the token limit (1,500 tokens: 10-20 s here).
LONG_REPLY = "Write a long essay about the history of Rome."


def _probe_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A probe file of this test's own (the run's shared one knows this machine already)."""
    return {"KVCHAT_PROBE_FILE": str(tmp_path / "probe.json"), **extra}


def known_outcomes_in(path: Path) -> list[ProbeOutcome]:
    return [ProbeOutcome.from_record(r) for r in ProbeBook(path).records()]


def _outcomes(tmp_path: Path) -> list[ProbeOutcome]:
    return known_outcomes_in(tmp_path / "probe.json")


def test_a_crash_with_repacking_turns_it_off_remembers_and_says_it_once(tmp_path, kvhome):
    env = _probe_env(tmp_path, **{CRASH_ENV: "repack"})
    first = run_cli(kvhome, "ask", "--new", "Name three colours", *FAST, env=env)
    assert first.stdout.strip()  # the turn replied
    said = [line for line in first.stderr.splitlines() if "weight repacking off" in line]
    assert len(said) == 1, first.stderr
    (outcome,) = _outcomes(tmp_path)
    assert outcome.trial.repack is False and outcome.wanted.repack is True
    if has_amx():  # "auto" never runs repacked weights there: nothing crashed, it is said why
        assert AMX_NOT_RUN in said[0]
        assert outcome.failures == [f"weight repacking on: {AMX_NOT_RUN}"]
    else:
        assert "killed by SIGSEGV in a test run" in said[0]
        assert outcome.failures == ["weight repacking on: killed by SIGSEGV"]
    assert outcome.speeds  # the child that worked measured the thread counts

    # Remembered: the next start probes nothing (a crashing child would add a failure) and
    # says nothing, but config and doctor always tell.
    again = run_cli(kvhome, "ask", "--new", "And four?", *FAST, env=env)
    assert "weight repacking off" not in again.stderr
    assert _outcomes(tmp_path)[0].when == outcome.when
    config = run_cli_here(kvhome, "config", env=env).stdout
    assert "engine probe: weight repacking off" in config
    assert "repack" in config and "probe" in config
    doctor = run_cli_here(kvhome, "doctor", env=env).stdout
    assert "weight repacking off: " + ("not run" if has_amx() else "llama.cpp crashed") in doctor


def test_the_repack_setting_overrides_the_probe(tmp_path, kvhome):
    crashing = _probe_env(tmp_path, **{CRASH_ENV: "repack"})
    if not has_amx():  # where repacked weights really crash, forcing them on would too
        # repack on and threads set: nothing to probe, the model runs as told.
        forced = run_cli(
            kvhome, "ask", "--new", "Hi", "--repack", "--threads", "1", *FAST, env=crashing
        )
        assert forced.stdout.strip() and "weight repacking" not in forced.stderr
        assert not (tmp_path / "probe.json").exists()
    # repack off from the environment: the probe only measures threads, nothing crashes.
    off = run_cli(kvhome, "ask", "--new", "Hi", *FAST, env={**crashing, "KVCHAT_REPACK": "off"})
    assert off.stdout.strip()
    (outcome,) = _outcomes(tmp_path)
    assert outcome.trial.repack is False and outcome.failures == []
    # The probe's choice goes to llama-server's command line too.
    line = run_cli_here(kvhome, "server", env={**crashing, "KVCHAT_REPACK": "off"}).stdout
    assert "--no-repack" in line.split()


def test_a_machine_where_everything_crashes_gets_one_line_and_keeps_the_message(tmp_path, kvhome):
    env = _probe_env(tmp_path, **{CRASH_ENV: "always"})
    result = run_cli(kvhome, "ask", "--new", "Hello there", *FAST, env=env, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "llama.cpp crashes on this machine whatever kvchat turns off" in line
    assert "Traceback" not in result.stderr


# --- a native crash of kvchat itself -----------------------------------------------------------


def _db_rows(home: Path, sql: str) -> list[tuple]:
    db = sqlite3.connect(home / "kvchat.db")
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def _wait_for_partial_reply(home: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (home / "kvchat.db").exists():
            try:
                rows = _db_rows(
                    home,
                    "SELECT length(content) FROM messages WHERE role = 'assistant' AND partial = 1",
                )
            except sqlite3.OperationalError:
                rows = []
            if rows and rows[0][0] > 0:
                return
        time.sleep(0.1)
    raise AssertionError("no partial reply was stored while the reply streamed")


def _segfault_mid_reply(home: Path, argv: list[str], message: str) -> None:
    """Run ``python ARGV`` (a kvchat sending ``message``), kill it by SIGSEGV once part of
    the reply is stored, and check that the message and the partial reply are there."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        env={**clean_env(), "KVCHAT_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_partial_reply(home, proc)
        os.kill(proc.pid, signal.SIGSEGV)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGSEGV
    messages = _db_rows(home, "SELECT role, content FROM messages ORDER BY id")
    assert messages[0] == ("user", message)
    assert messages[1][0] == "assistant" and messages[1][1].strip()


def test_a_segfault_mid_reply_keeps_the_text_and_is_reported_on_the_next_start(
    kvhome, own_probe_file
):
    argv = ["-m", "kvchat", "ask", "--new", LONG_REPLY, "--temperature", "0"]
    argv += ["--max-tokens", "1500", "--n-ctx", "2048", "--threads", "1"]
    _segfault_mid_reply(kvhome, argv, LONG_REPLY)
    (log,) = (kvhome / "crashes").glob("run-*.log")
    assert "Segmentation fault" in log.read_text()
    # The crashed run left its marker: the verdict it ran on.
    (marker,) = own_probe_file.parent.glob("own-probe.json.use-*")
    key = json.loads(marker.read_text())["key"]
    (verdict,) = [o for o in known_outcomes_in(own_probe_file) if o.key == key]

    # The next start says it once, on one line; the conversation is there. The verdict the
    # crash ran on is withdrawn and probed again (from the same options: the child runs).
    listed = run_cli(kvhome, "ask", "--new", "Hi", *FAST)
    (again,) = [o for o in known_outcomes_in(own_probe_file) if o.key == key]
    assert again.failures[-1].endswith(": crashed in use") and again.when >= verdict.when
    assert not list(own_probe_file.parent.glob("own-probe.json.use-*"))
    crash_lines = [line for line in listed.stderr.splitlines() if "ended in a crash" in line]
    assert len(crash_lines) == 1 and str(log) in crash_lines[0]
    assert "conversations are intact" in crash_lines[0]
    assert "ended in a crash" not in run_cli(kvhome, "ask", "--new", "Hi", *FAST).stderr
    doctor = run_cli_here(kvhome, "doctor").stdout
    assert f"log: {log}" in doctor


def test_the_service_opens_the_model_on_a_smaller_plan_and_says_why(kvhome, monkeypatch):
    """An engine that fails as a GPU that is out of memory does, until the plan is small
    enough; then the real engine on the CPU (this build has no GPU)."""
    from kvchat.service import engine_host
    from kvchat.service.chat import ChatService

    monkeypatch.setattr("kvchat.planner.defaults.gpu_offload_supported", lambda: True)
    real = engine_host.create_engine
    tried: list[tuple[int, int]] = []

    def failing(settings, path, *, config):
        tried.append((config.n_ctx, config.n_gpu_layers))
        if config.n_ctx > 4096:
            raise KvchatError(
                "could not load model: ggml_backend_cuda_buffer_type_alloc_buffer: "
                "allocating 9000.00 MiB on device 0: cudaMalloc failed: out of memory"
            )
        return real(settings, path, config=config)

    monkeypatch.setattr(engine_host, "create_engine", failing)
    service = ChatService(load_settings(vram="6GiB", n_threads=1, temperature=0, max_tokens=8))
    try:
        service.load_engine()
        assert [ctx for ctx, _ in tried] == [8192, 4096]
        assert service.host.plan is not None and service.host.plan.n_ctx == 4096
        assert "the GPU could not open the model with n_ctx 8,192" in (service.host.plan_note or "")
        report = service.start("Hi")
        assert report.reply
    finally:
        service.close()


# --- threads ---------------------------------------------------------------------------------


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


@pytest.mark.stress  # it loads every core on purpose (the other worker's tests with it)
def test_the_thread_choice_follows_a_measurement_made_under_load():
    config = EngineConfig(bundled_model_path(), n_ctx=1024, n_threads=os.cpu_count() or 2)
    physical = min(os.cpu_count() or 2, 4)
    quiet = run_probe(config, repack_fixed=False, physical=physical, book=None)
    loops = _busy_loops(os.cpu_count() or 2)
    try:
        busy = run_probe(config, repack_fixed=False, physical=physical, book=None)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    for outcome in (quiet, busy):
        best = max(outcome.speeds, key=lambda n: outcome.speeds[n]["generate"])
        assert outcome.best_threads("generate") == int(best)
    print(json.dumps({"quiet": quiet.speeds, "busy": busy.speeds}))
    # Every core busy elsewhere: running on all of them collapses (threads wait for each
    # other at every step); the measurement sees it.
    top = str(physical)
    assert busy.speeds[top]["generate"] < 0.8 * quiet.speeds[top]["generate"]


def test_a_reply_far_slower_than_measured_makes_the_engine_measure_again():
    from kvchat.engine.llama import LlamaEngine

    # A measurement no CPU reaches: the next reply is "far slower", and the engine re-checks.
    config = EngineConfig(
        bundled_model_path(),
        n_ctx=1024,
        n_threads=1,
        thread_speeds=((1, 1e6, 1e6), (2, 1e6, 1e6)),
    )
    engine = LlamaEngine(config)
    try:
        engine.prefill(engine.chat_tokens([{"role": "user", "content": "Count to twenty."}]))
        stats = GenerationStats()
        "".join(engine.generate(GenerationParams(temperature=0, max_tokens=24), stats))
        assert stats.generated >= 16
        assert engine.slowdowns == 1
        measured = {n for n, _, _ in engine.config.thread_speeds}
        assert measured == {1, 2}
        assert all(gen < 1e6 for _, _, gen in engine.config.thread_speeds)
        fastest_now = max(engine.config.thread_speeds, key=lambda row: (row[2], -row[0]))[0]
        assert engine.config.n_threads == fastest_now
    finally:
        engine.close()


# The app in a process of its own, as `kvchat` runs it (with its crash log), sending one
# message whose reply is long; the test kills it mid-reply.
_APP_SCRIPT = """
import asyncio, sys
from kvchat.config import Settings
from kvchat.paths import data_dir
from kvchat.crashes import start_crash_log
from kvchat.tui.app import KvchatApp

async def main():
    start_crash_log(data_dir())
    settings = Settings(temperature=0, max_tokens=1500, n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=(100, 30)) as pilot:
        while not app.main.ready:
            await asyncio.sleep(0.05)
        app.main.prompt.focus()
        app.main.prompt.insert(sys.argv[1])
        await pilot.press("enter")
        while True:
            await asyncio.sleep(0.1)

asyncio.run(main())
"""


async def test_the_app_killed_by_sigsegv_mid_reply_loses_nothing_and_says_so_next_time(
    kvhome: Path, own_probe_file: Path
) -> None:
    from kvchat.tui.app import KvchatApp

    _segfault_mid_reply(kvhome, ["-c", _APP_SCRIPT, LONG_REPLY], LONG_REPLY)

    app = KvchatApp(Settings(temperature=0, max_tokens=8, n_ctx=2048, n_threads=1))
    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 60
        while not app.main.ready and time.monotonic() < deadline:
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        said = [n.message for n in app._notifications if "ended in a crash" in n.message]
        assert len(said) == 1 and "conversations are intact" in said[0]
        # The conversation is there, reopened with its partial reply.
        assert [v.role for v in app.main.conversation.views][:2] == ["user", "assistant"]
    doctor = run_cli_here(kvhome, "doctor").stdout
    assert "crash " in doctor and "log: " in doctor
