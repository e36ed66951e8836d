"""Shared fixtures (a private KVCHAT_HOME per test, a runner for the real `kvchat` CLI) and the
order of the tests: unit tests first, end-to-end tests after (see pytest_collection_modifyitems)."""

from __future__ import annotations

import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# pytest rewrites each test module's asserts and keeps the result in __pycache__ only where
# bytecode may be written: with PYTHONDONTWRITEBYTECODE=1 (CI's environment) every worker
# rewrote all ~380 modules at every run (~8 s of CPU each). Test modules are written; the
# ``kvchat`` processes the tests start keep the environment's setting.
sys.dont_write_bytecode = False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile kvchat's modules to bytecode once: the hundreds of ``kvchat`` processes the
    tests start then read it, where each compiled the package from source (~0.1 s a
    process here: CI's environment sets PYTHONDONTWRITEBYTECODE=1, so Python never writes
    it itself; an installed wheel has it from pip)."""
    compileall.compile_dir(REPO / "app" / "kvchat", quiet=2)


# KVCHAT_TEST_CPU=DIR: each worker writes, per test, the CPU seconds this process and the
# processes it waited for spent (``resource.getrusage``), as JSON lines in DIR. The suite's
# cost, read on a busy machine where wall times say little (tests/README.md, "Time").
CPU_LOG_ENV = "KVCHAT_TEST_CPU"


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Writes ``item``'s CPU seconds (setup, call and teardown) when KVCHAT_TEST_CPU is set."""
    where = os.environ.get(CPU_LOG_ENV)
    if not where:
        return (yield)
    started, cpu = time.monotonic(), _cpu_seconds()
    try:
        return (yield)
    finally:
        line = {
            "test": item.nodeid,
            "cpu_s": round(_cpu_seconds() - cpu, 3),
            "wall_s": round(time.monotonic() - started, 3),
        }
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(where) / f"{worker}.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


# Short, deterministic turns: greedy decoding, few tokens, a small context (the proofs that a
# restore replies as a full prefill compare 32 tokens: e2e/resume/test_restore_equals_prefill).
FAST = ["--temperature", "0", "--max-tokens", "12", "--n-ctx", "1024"]

# What a test is follows from its folder (see pytest_collection_modifyitems). tests/faults,
# the boundary campaigns, mixes both kinds and marks its tests one by one.
TESTS = REPO / "tests"
FOLDER_MARKS = {"unit": (), "e2e": ("e2e",), "stress": ("stress",), "faults": ()}


def folder(item: pytest.Item) -> str:
    """The top folder under tests/ that holds ``item`` (unit, e2e, faults or stress)."""
    return item.path.relative_to(TESTS).parts[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by its folder and run the unit tests (no model, no process: seconds)
    first, the end-to-end tests after.

    tests/unit: no mark (the guard ``unit_tests_start_nothing`` holds them to it);
    tests/e2e: ``e2e``; tests/stress: ``stress``; tests/faults keeps its own marks. A test
    anywhere else, or a unit test marked ``e2e`` by hand, is a collection error. The hook runs
    before ``-m`` selection, so ``pytest -m "not e2e and not stress"`` runs the unit tests
    alone and ``pytest -m "e2e and not stress"`` the rest. ``stress`` tests (long runs) are
    deselected by the addopts in pyproject.toml (a ``-m`` given replaces it); ``pytest -m
    stress`` runs them. The order within each group is the collection order.
    """
    for item in items:
        where = folder(item)
        if where not in FOLDER_MARKS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in tests/{{unit,e2e,faults,stress}}/"
            )
        if where == "unit" and item.get_closest_marker("e2e") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked e2e: move it to tests/e2e/")
        for mark in FOLDER_MARKS[where]:
            item.add_marker(getattr(pytest.mark, mark))
        group = shared_setup(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def starts_nothing(item: pytest.Item) -> bool:
    """Whether ``item`` is held to starting no process and loading no model: every test in
    tests/unit, and the tests of tests/faults not marked ``e2e``."""
    where = folder(item)
    return where == "unit" or (where == "faults" and item.get_closest_marker("e2e") is None)


# Session fixtures of tests/ that cost nothing to make again on a second worker.
CHEAP_SHARED = {
    "shared_probe",
    "models_load_only_as_probed",
    "probed_repack",
    "titles_off",
    "one_thread_per_engine",
}


def shared_setup(item: pytest.Item) -> str | None:
    """The expensive setup ``item`` shares with other tests, as an xdist group name: a
    session fixture of tests/ (``turn_homes``: one ``kvchat ask`` per snapshot format) by its
    name, a module fixture (a llama-server, a loaded model, a built wheel) by its module. With
    ``--dist loadgroup`` the tests of one group run on one worker, which makes it once."""
    # pytest has no public way to ask which fixture definitions an item will use.
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return None
    module_group = None
    for name in item.fixturenames:
        found = definitions.name2fixturedefs.get(name)
        if not found or not found[-1].baseid or name in CHEAP_SHARED:
            continue  # a plugin's fixture (no baseid) or a cheap one
        if found[-1].scope == "session":
            return name
        if found[-1].scope in ("package", "module"):
            module_group = item.path.relative_to(TESTS).as_posix()
    return module_group


# The engine probe's outcomes (kvchat.engine.probe), shared by every home of the run: a test
# home is new each time, the machine is not. Variables of this set survive the tests' clean
# environments.
PROBE_FILE_ENV = "KVCHAT_PROBE_FILE"
# A test-only defect a run plants on purpose (kvchat.kvcache.defects) reaches every process.
PLANT_ENV = "KVCHAT_PLANT_DEFECT"
# A llama-server binary named by hand (kvchat.engine.server_build.BINARY_ENV): the machine's,
# like the probe file, so the `kvchat server start` of a test finds it too.
SERVER_BINARY_ENV = "KVCHAT_LLAMA_SERVER"
# Automatic session titles (a second decode after each session's first reply) are off in
# every test but the titles tests' own (tests/e2e/titles/conftest.py turns them back on).
AUTO_TITLE_ENV = "KVCHAT_AUTO_TITLE"
# One llama.cpp thread per engine in every test (tests of the probe's thread choice unset
# it): two xdist workers on two cores, each engine running as many threads as there are
# cores, make llama.cpp's threads spin-wait on each other. Measured on this 2-core machine:
# two `kvchat ask` at once generated 1.8 tok/s each with 2 threads, 41-43 tok/s with 1.
THREADS_ENV = "KVCHAT_N_THREADS"
KEPT_ENV = (
    "KVCHAT_HOME",
    PROBE_FILE_ENV,
    PLANT_ENV,
    SERVER_BINARY_ENV,
    AUTO_TITLE_ENV,
    THREADS_ENV,
)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_engine() -> None:
    """One llama.cpp thread per engine for the run (see THREADS_ENV), unless the run's
    environment names a count."""
    os.environ.setdefault(THREADS_ENV, "1")


@pytest.fixture
def threads_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread count from the environment: the engine probe's measurement chooses."""
    monkeypatch.delenv(THREADS_ENV, raising=False)


@pytest.fixture(scope="session", autouse=True)
def titles_off() -> None:
    """Automatic titles off for the run (the variable reaches the tests' `kvchat` processes
    and the settings tests load in-process)."""
    os.environ[AUTO_TITLE_ENV] = "false"


@pytest.fixture(scope="session", autouse=True)
def shared_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One engine-probe file for the whole run: the first model load on this machine
    probes it (on a CPU where llama.cpp's repacked weights crash, the probe turns them off
    for every test), later loads read it."""
    path = Path(os.environ.get(PROBE_FILE_ENV) or tmp_path_factory.mktemp("probe") / "probe.json")
    os.environ[PROBE_FILE_ENV] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def models_load_only_as_probed(shared_probe: Path) -> Any:
    """A guard: a model loaded in the test process with llama.cpp's weight repacking on must
    be one the engine probe vouched for on this machine (kvchat.engine.probe.VOUCHED_REPACK).
    A bare ``llama_cpp.Llama`` (repacking on by default) fails its test here, where on a CPU
    whose repacked kernels crash (Intel AMX) it would take the whole pytest process down.
    Tests open models through kvchat's engine, or take the options from ``probed_repack``."""
    import llama_cpp

    from kvchat.engine import probe

    original = llama_cpp.Llama.__init__

    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        path = kwargs.get("model_path", args[0] if args else None)
        repack = bool(llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts)
        if repack and str(path) not in probe.VOUCHED_REPACK and not UNPROBED_REPACK:
            pytest.fail(
                f"{path} was loaded with weight repacking on that the engine probe did not "
                "vouch for: open models through kvchat's engine or the probed_repack fixture"
            )
        original(self, *args, **kwargs)

    llama_cpp.Llama.__init__ = guarded  # type: ignore[method-assign]
    yield
    llama_cpp.Llama.__init__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def unit_tests_start_nothing(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard: a unit test starts no process and loads no model (those are what make a test
    slow; the unit tests alone run in seconds). A test that must lives in tests/e2e/ (or
    tests/stress/; in tests/faults, is marked ``e2e``)."""
    if not starts_nothing(request.node):
        return
    import subprocess

    name = request.node.nodeid

    def refused(what: str) -> Callable[..., Any]:
        def fail(*_args: Any, **_kwargs: Any) -> Any:
            pytest.fail(f"{name} is a unit test but {what}: it belongs in tests/e2e/")

        return fail

    monkeypatch.setattr(subprocess.Popen, "__init__", refused("started a process"))
    monkeypatch.setattr("kvchat.engine.llama.LlamaEngine.__init__", refused("loaded a model"))


@pytest.fixture(autouse=True)
def os_calls_put_back(request: pytest.FixtureRequest) -> Any:
    """A guard: a test that forces one of kvchat.system's implementations puts back the one
    for this OS (a leak made every later test on the worker run the Windows one)."""
    from kvchat import system

    native = system.use(None).name
    yield
    leaked = system.current().name
    if leaked != native:
        system.use(native)
        pytest.fail(f"{request.node.nodeid} left kvchat.system on {leaked!r}, not {native!r}")


# Set while a test marked ``unprobed_repack`` runs (one that loads tiny F16 models with
# repacking on, which crashes nothing: see test_sliding_window).
UNPROBED_REPACK: list[str] = []


@pytest.fixture(autouse=True)
def _unprobed_repack(request: pytest.FixtureRequest) -> Any:
    marked = request.node.get_closest_marker("unprobed_repack") is not None
    if marked:
        UNPROBED_REPACK.append(request.node.nodeid)
    yield
    if marked:
        UNPROBED_REPACK.remove(request.node.nodeid)


def probe_says_repack(path: Path) -> bool:
    """Whether the engine probe vouches for weight repacking with ``path`` on this machine:
    the one place a test that loads a model other than through kvchat's engine (``llama_cpp``
    itself, a llama-server it starts) takes it from."""
    from kvchat.engine.api import EngineConfig
    from kvchat.engine.probe import probed_config

    config, _ = probed_config(EngineConfig(path, n_ctx=512, n_threads=2), in_use=True)
    return bool(config.repack)


@pytest.fixture(scope="session")
def probed_repack() -> Callable[[Path], bool]:
    """:func:`probe_says_repack` as a fixture (then ``with
    kvchat.engine.llama.weight_repack(probed_repack(path)): …``)."""
    return probe_says_repack


@pytest.fixture
def own_probe_file(shared_probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the run's probe file for a test that crashes kvchat on purpose (SIGSEGV):
    such a crash withdraws the verdict it ran on (kvchat.engine.probe_book), which must not
    make every later test probe again."""
    own = tmp_path / "own-probe.json"
    if shared_probe.is_file():
        shutil.copyfile(shared_probe, own)
    monkeypatch.setenv(PROBE_FILE_ENV, str(own))
    return own


def clean_env() -> dict[str, str]:
    """This process's environment without kvchat's settings (``KVCHAT_*``), for a `kvchat`
    process of a test; the run's shared engine-probe file, a planted defect, a llama-server
    binary named by hand and the titles switch stay."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_") or k in KEPT_ENV[1:]}


@pytest.fixture
def kvhome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh KVCHAT_HOME for this test (database, snapshots and config)."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    for name in list(os.environ):
        if name.startswith("KVCHAT_") and name not in KEPT_ENV:
            monkeypatch.delenv(name)
    return home


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def run_cli(
    home: Path,
    *args: str,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
) -> CliResult:
    """Run `python -m kvchat ARGS` in a new process with KVCHAT_HOME=home."""
    full_env = clean_env()
    full_env["KVCHAT_HOME"] = str(home)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result = CliResult(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvchat {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return result


def run_cli_here(
    home: Path,
    *args: str,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
) -> CliResult:
    """``kvchat ARGS`` in this process (click's runner) with KVCHAT_HOME=home and the
    environment :func:`run_cli` gives a process: for a test of what a command says and
    stores, where no process boundary is under test (a kill, a signal, a second process, a
    crash, stdin or the terminal). Saves the interpreter's start and kvchat's imports (~0.4 s
    of CPU a command here). An exception that escapes is a traceback on stderr, exit 1, as
    in a process; ``timeout`` is not enforced here."""
    import traceback

    from click.testing import CliRunner

    from kvchat.cli import main

    wanted = {**clean_env(), "KVCHAT_HOME": str(home), **(env or {})}
    changes: dict[str, str | None] = {k: None for k in os.environ if k not in wanted}
    changes.update(wanted)
    result = CliRunner().invoke(main, list(args), env=changes, catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    outcome = CliResult(result.exit_code, result.stdout, stderr)
    if check and outcome.returncode != 0:
        raise AssertionError(f"kvchat {' '.join(args)} failed ({outcome.returncode}):\n{stderr}")
    return outcome


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """Runs a ``kvchat`` command in this process (:func:`run_cli_here`); tests of a process
    boundary use :func:`run_cli`."""
    return run_cli_here


# Environment that selects each snapshot format.
SNAPSHOT_FORMATS = {"chunks": {}, "blob": {"KVCHAT_SNAPSHOT_CHUNKS": "false"}}


@pytest.fixture(scope="session")
def turn_homes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """Per snapshot format: a KVCHAT_HOME holding one session after one greedy turn."""
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(fmt: str) -> tuple[Path, dict[str, Any]]:
        if fmt not in made:
            home = tmp_path_factory.mktemp(f"one-turn-{fmt}") / "home"
            env = SNAPSHOT_FORMATS[fmt]
            made[fmt] = (home, run_cli(home, "ask", "--new", "Hi", "--json", *FAST, env=env).json)
        return made[fmt]

    return get


@pytest.fixture
def one_turn_home(turn_homes) -> tuple[Path, dict[str, Any]]:
    """A KVCHAT_HOME holding one session after one greedy turn (chunked snapshots)."""
    return turn_homes("chunks")


@pytest.fixture
def copy_home(tmp_path: Path) -> Callable[[Path, str], Path]:
    """Copy a KVCHAT_HOME so that two futures of one conversation can be compared."""

    def copy(source: Path, name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(source, target)
        return target

    return copy
