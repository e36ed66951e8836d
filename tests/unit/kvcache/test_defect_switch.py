"""The test-only defect switch (``KVCHAT_PLANT_DEFECT``, read by
:mod:`kvchat.kvcache.defects` alone) is off unless set, names only the known defects, and
each defect is consulted in the code. The proofs that the key tests fail with a defect
planted are tests/stress/test_planted_defects.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvchat.kvcache import defects
from kvchat.kvcache.defects import DEFECTS, ENV, planted
from tests.conftest import REPO

# ------------------------------------------------------------------- the switch (default run)


def test_no_defect_is_planted_unless_the_switch_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert [name for name in sorted(DEFECTS) if planted(name)] == []
    monkeypatch.setenv(ENV, "")
    assert [name for name in sorted(DEFECTS) if planted(name)] == []
    monkeypatch.setenv(ENV, "stale-ram")
    assert [name for name in sorted(DEFECTS) if planted(name)] == ["stale-ram"]


def test_the_switch_knows_only_the_four_defects(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFECTS == {"shifted-cell", "dropped-chunk", "stale-ram", "window-piece"}
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match="no planted defect is named 'stale-rams'"):
        planted("stale-rams")
    monkeypatch.setenv(ENV, "shifted_cell")  # a typo never passes for a clean run
    with pytest.raises(ValueError, match="names no planted defect"):
        planted("shifted-cell")


def test_each_defect_is_consulted_and_only_the_defects_module_reads_the_switch() -> None:
    sources = {
        path: path.read_text()
        for path in (REPO / "app" / "kvchat").rglob("*.py")
        if path != Path(defects.__file__)
    }
    consulted = {
        name for text in sources.values() for name in re.findall(r'planted\("([^"]+)"\)', text)
    }
    assert consulted == DEFECTS
    assert [path.name for path, text in sources.items() if ENV in text] == []
