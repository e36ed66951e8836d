"""The checks CI runs as tests: ruff (lint and format), the import-linter contracts in
pyproject.toml (the layers among them), mypy on the service and its seams, no import
circles, and the same layering at run time (the domain loads neither textual nor click).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def tool(name: str) -> str:
    """The console script next to this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def check(*args: str) -> None:
    proc = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"NO_COLOR": "1"},
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def test_ruff_lint() -> None:
    check(tool("ruff"), "check", "--no-fix", "--output-format=concise", "app", "tests")


def test_ruff_format() -> None:
    check(tool("ruff"), "format", "--check", "--output-format=concise", "app", "tests")


def test_import_contracts() -> None:
    check(tool("lint-imports"), "--no-cache", "--no-logo")


def test_the_service_and_its_seams_type_check() -> None:
    """mypy, strict on the files [tool.mypy] names (the service, the engine protocol, the
    KV tiers)."""
    check(tool("mypy"))  # incremental: its cache (.mypy_cache, ignored) is checked per file


def test_no_package_imports_another_that_imports_it_back() -> None:
    """No circle among kvchat's packages and root modules (the layers contract allows none
    between layers; this also covers modules outside the layers)."""
    import grimp

    graph = grimp.build_graph("kvchat", exclude_type_checking_imports=True, cache_dir=None)

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if unit(imported) != unit(module) and imported != "kvchat":
                edges.setdefault(unit(module), set()).add(unit(imported))
    circles = sorted(
        f"{a} <-> {b}" for a, targets in edges.items() for b in targets if a in edges.get(b, ())
    )
    assert not circles, circles


# Imports of textual or click made by kvchat's own modules while the domain loads. click may
# still be in sys.modules afterwards: sqlite-utils imports it for its plugin hooks.
HYGIENE = """
import builtins, sys
made = []
real_import = builtins.__import__

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if level == 0 and name.partition(".")[0] in ("textual", "click"):
        if importer.partition(".")[0] == "kvchat":
            made.append(f"{importer} imports {name}")
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy
import kvchat.service.chat, kvchat.service.exports, kvchat.store, kvchat.kvcache
made += ["textual is loaded"] if "textual" in sys.modules else []
print("\\n".join(made))
"""


def test_the_domain_imports_neither_textual_nor_click() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HYGIENE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"loading the domain:\n{proc.stdout}"
