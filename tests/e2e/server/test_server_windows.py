"""A sliding-window model on llama-server keeps window-sized caches and still resumes exactly.

kvchat used to start llama-server with ``--swa-full`` for every sliding-window model (every
layer full-length: ~5x the KV on Gemma 3). Now the server runs as the in-process engine
does: window-sized caches unless the ``swa_full`` setting asks otherwise, and a session
restored from its slot file (the window's cells and the full layers) continues exactly as a
full prefill does. Gemma 3 270M is the real sliding-window model (window 512).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.engine.server_build import plan_server
from tests.e2e.families.test_families import LONG_FIRST, gemma3_270m
from tests.e2e.server.test_server import Server, ask

N_CTX = 4096  # per slot: more than the window's ring (pad256(512 + n_ubatch 512) = 1,024)

__all__ = ["gemma3_270m"]  # the fixture (tests/e2e/families/test_families.py)


def test_the_server_command_keeps_full_window_layers_only_when_the_setting_asks(
    gemma3_270m: Path,
) -> None:
    # repack fixed: nothing to probe for the command line.
    windows = plan_server(load_settings(model=str(gemma3_270m), repack="on"))
    assert windows.swa is False and "--swa-full" not in windows.argv()
    full = plan_server(load_settings(model=str(gemma3_270m), repack="on", swa_full=True))
    assert full.swa is True and "--swa-full" in full.argv()


@pytest.fixture(scope="module")
def gemma_server(gemma3_270m: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(
        tmp_path_factory.mktemp("gemma-server") / "slots",
        slots=1,
        extra=("-lv", "4"),  # the log then names the caches' sizes
        model=gemma3_270m,
        n_ctx=N_CTX,
    )
    yield running
    running.stop()


def _window_cells(log: Path) -> list[int]:
    """The cell counts of the sliding-window caches llama-server allocated, from its log."""
    text = log.read_text(errors="replace")
    return [int(n) for n in re.findall(r"creating\s+SWA KV cache, size = (\d+) cells", text)]


# A real Gemma 3 270M server turn past its 512-token window, four times: minutes on two cores.
# The default run proves the server path on the bundled model (test_server.py) and Gemma's
# windows in-process (test_sliding_window.py); this runs in CI's second step.
@pytest.mark.stress
def test_a_session_longer_than_the_window_resumes_from_its_slot_file(
    gemma_server: Server, tmp_path: Path
) -> None:
    """Window-sized caches, and a slot file restored in two different slot states continues
    the same way (the server runs at one thread count, so this is deterministic).

    Not asserted: equality with a full prefill. On this Gemma the server's full prefill
    departs from the turn-by-turn KV after ~20 greedy tokens with and without --swa-full and
    with and without weight repacking (measured), while the in-process engine is exact on
    the same model (tests/e2e/families/test_sliding_window.py); the server engine's exactness is proved
    on the bundled model (tests/e2e/server/test_server.py)."""
    cells = _window_cells(gemma_server.log)
    assert cells and max(cells) < N_CTX, cells  # window-sized, not n_ctx
    home = tmp_path / "home"
    first = ask(home, gemma_server.url, "--new", LONG_FIRST).json
    session = first["session"]
    assert first["tokens"]["prompt"] > 512  # past the window
    ask(home, gemma_server.url, "--session", session, "Which town trades the most cider?")
    in_slot = tmp_path / "in-slot"
    shutil.copytree(home, in_slot)
    kept = ask(in_slot, gemma_server.url, "--session", session, "And the least?").json
    # Another session takes the one slot (the server drops the first one's cells):
    ask(home, gemma_server.url, "--new", "Hello there.")
    restored = ask(home, gemma_server.url, "--session", session, "And the least?").json
    for report in (kept, restored):
        assert report["restore"]["from"] == "server", report["restore"]
        assert report["restore"]["tokens"] > 512
        assert report["tokens"]["reused"] >= report["restore"]["tokens"] - 1
        assert report["tokens"]["decoded"] < 64, report["tokens"]
    assert restored["reply"] == kept["reply"]
