"""The app as a user installs it: build the wheel, install it into a fresh virtual environment,
and run `kvchat` from a directory outside the repository.

One wheel and one venv for the module (about a minute, most of it pip). Dependencies come from
PyPI through pip's cache, constrained to the versions of this test environment, so the
llama-cpp-python wheel pip built once is reused rather than rebuilt.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import InvalidVersion, Version

# Building the wheel and a fresh environment takes ~40 s of the default run's ten minutes: it
# runs in CI's second step (`.ci/run`, `-m stress`), as the packaging check it is.
pytestmark = pytest.mark.stress

REPO = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CATALOG = tomllib.loads((REPO / "models" / "catalog.toml").read_text())
# Not copied into the build: what .gitignore ignores, and the repository itself.
IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".*_cache", "tests"
)


HEADLESS = """
import asyncio, json, sys, time
from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen

async def main():
    app = KvchatApp(Settings(n_ctx=512), cursor_blink=False)
    async with app.run_test(size=(100, 30)):
        screen = app.screen_stack[0]
        assert isinstance(screen, MainScreen), screen
        deadline = time.monotonic() + 120
        while not screen.ready:
            assert time.monotonic() < deadline, "the model did not load"
            await asyncio.sleep(0.05)
        css = [path for path, _ in app.stylesheet.source if path.endswith("kvchat.tcss")]
        app.simulate_key("ctrl+q")  # not pilot.press: it would wait for a screen that is gone
        while app.return_code is None:
            assert time.monotonic() < deadline, "ctrl+q did not quit"
            await asyncio.sleep(0.05)
    print(json.dumps({"css": css, "screen": type(screen).__name__, "code": app.return_code}))

asyncio.run(main())
"""


@dataclass
class Installed:
    wheel: Path
    bin: Path  # the venv's scripts folder
    site: Path  # its site-packages
    cwd: Path  # outside the repository
    home: Path  # KVCHAT_HOME

    def run(self, program: str, *args: str, timeout: float = 300) -> str:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KVCHAT_", "PYTHON")) or k == "KVCHAT_PROBE_FILE"
        }
        env["KVCHAT_HOME"] = str(self.home)
        proc = subprocess.run(
            [str(self.bin / program), *args],
            cwd=self.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{program} {' '.join(args)}: {proc.returncode}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.stdout


def pip(python: Path, *args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def current_versions() -> str:
    """Constraints: every distribution of this environment at its installed version."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or name.lower() == PROJECT["name"]:
            continue
        try:
            Version(dist.version)
        except InvalidVersion:
            continue
        pins[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source, dist, env, outside = root / "src", root / "dist", root / "venv", root / "elsewhere"
    shutil.copytree(REPO, source, ignore=IGNORED)  # a clean tree: no build/ left over
    outside.mkdir()
    pip(Path(sys.executable), "wheel", "--no-deps", "-w", str(dist), str(source), cwd=root)
    (wheel,) = dist.glob("kvchat-*.whl")

    venv.create(env, with_pip=True)
    python = env / ("Scripts" if os.name == "nt" else "bin") / "python"
    constraints = root / "constraints.txt"
    constraints.write_text(current_versions())
    pip(python, "install", "-c", str(constraints), str(wheel), cwd=outside)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Installed(wheel, python.parent, Path(site), outside, root / "home")


def test_the_wheel_holds_the_package_and_its_data(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert "kvchat/__init__.py" in names
    assert "kvchat/assets/kvchat.tcss" in names
    assert "kvchat/models/catalog.toml" in names
    assert "kvchat/py.typed" in names
    tops = {name.split("/")[0] for name in names}
    assert tops == {"kvchat", f"kvchat-{PROJECT['version']}.dist-info"}, tops


def test_no_top_level_app_package(installed: Installed) -> None:
    assert not (installed.site / "app").exists()
    out = installed.run("python", "-c", "import importlib.util as u; print(u.find_spec('app'))")
    assert out.strip() == "None"


def test_version(installed: Installed) -> None:
    assert PROJECT["version"] in installed.run("kvchat", "--version")


def test_models_list_shows_the_whole_catalog(installed: Installed) -> None:
    out = installed.run("kvchat", "models", "list")
    names = [entry["name"] for entry in CATALOG["model"]]
    assert len(names) >= 2
    for name in names:
        assert re.search(rf"^{re.escape(name)}\s", out, re.MULTILINE), f"{name} missing:\n{out}"


def test_ask_one_turn_on_the_bundled_model(installed: Installed) -> None:
    args = ["--json", "--temperature", "0", "--max-tokens", "8", "--n-ctx", "512"]
    reply = json.loads(installed.run("kvchat", "ask", "--new", "Hi", *args))
    assert isinstance(reply["reply"], str) and reply["reply"].strip()
    tokens = reply["tokens"]
    assert tokens["prompt"] > 0 and tokens["decoded"] == tokens["prompt"]  # a new session
    assert 0 < tokens["generated"] <= 8


def test_the_app_starts_headless_with_its_stylesheet_and_quits(installed: Installed) -> None:
    report = json.loads(installed.run("python", "-c", HEADLESS).splitlines()[-1])
    assert report["screen"] == "MainScreen" and report["code"] == 0
    (css,) = report["css"]
    assert Path(css).is_relative_to(installed.site / "kvchat" / "assets"), css
