"""Sliding-window models with window-sized caches: ``swa_full`` off by default.

llama.cpp (llama-cpp-python 0.3.36) gives each sliding-window layer a ring of
``pad256(min(n_ctx, n_swa × n_seq + n_ubatch))`` cells; a cell is overwritten only once it
has left every window, so the context can be cut back as far as the ring still reaches
(``LlamaEngine.window_floor``), and below that only at a window checkpoint: held in RAM
by the engine (a regenerate of a long reply), else read from disk (a restore). Never a
window short of cells. Tiny random-weight Gemma 3 and Gemma 2 GGUFs (tests/tiny_models.py)
with ``n_batch`` 64 keep a 256-cell ring, so a few hundred tokens leave it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from kvchat.config import load_settings
from kvchat.engine import EngineConfig, GenerationParams, GenerationStats
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.planner import read_gguf
from kvchat.planner.plan import PlanConfig, memory_at, window_cells
from kvchat.service.chat import ChatService
from tests.conftest import run_cli_here
from tests.e2e.families.test_families import (
    FLAGS,
    KV_LOG,
    both_ways,
    check_equal,
    copies,
    fork_at,
    gemma3_270m,
    kv_log,
    regenerate,
)
from tests.tiny_models import FAMILIES, write_family, write_tiny

RING_BATCH = 64  # n_batch (= n_ubatch): a ring of pad256(32 + 64) = 256 cells
FIRST = (
    "Here is a long question about rivers, salt, wool and cider, the trade of old towns, "
    "and how their markets worked every autumn, who came to them from the hills and what "
    "they brought. Tell me a long story about one of those towns."
)
SECOND = "What did the miller say?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    folder = tmp_path_factory.mktemp("tiny-windows")

    def get(name: str) -> Path:
        path = folder / f"{name}.gguf"
        if not path.exists():
            if name in FAMILIES:
                write_tiny(FAMILIES[name], path)
            else:  # the families of tests/tiny_families.json (gpt-oss, gemma4)
                write_family(name, path)
        return path

    return get


def open_engine(path: Path, **extra: Any) -> Any:
    from kvchat.engine.llama import LlamaEngine

    values: dict[str, Any] = {"n_ctx": 1024, "n_batch": RING_BATCH, "n_threads": 1}
    return LlamaEngine(EngineConfig(path, **(values | extra)))


TOKENS = [100 + (i * 37) % 4000 for i in range(900)]


# ------------------------------------------------------------------- what llama.cpp keeps


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("n_batch", [RING_BATCH, 512])
@pytest.mark.parametrize("swa_full", [False, True])
def test_llama_cpp_allocates_the_planners_window_cells(
    family: str, n_batch: int, swa_full: bool, tiny: Callable[[str], Path]
) -> None:
    path = tiny(family)
    info = read_gguf(path)
    cfg = PlanConfig(flash_attn=False, swa_full=swa_full, n_ubatch=n_batch)
    with kv_log() as lines:
        engine = open_engine(path, n_batch=n_batch, swa_full=swa_full)
    try:
        sizes = [
            (float(m.group(1)) * 2**20, int(m.group(2))) for m in map(KV_LOG.search, lines) if m
        ]
        planned = memory_at(info, 1024, 0, cfg)
        # llama.cpp logs MiB with two decimals: ±0.005 MiB a line; the cells are exact.
        total = sum(size for size, _ in sizes)
        assert total == pytest.approx(planned["host_kv"], abs=0.005 * 2**20 * len(sizes))
        cells = sorted(count for _, count in sizes)
        windows = window_cells(info, 1024, cfg)
        assert cells == sorted([1024, 1024 if swa_full else windows])
        if not swa_full:
            assert windows == (256 if n_batch == RING_BATCH else 768)
            # No scratch sequence beside the conversation: it would add another window.
            assert llama_cpp.llama_n_seq_max(engine.ctx) == 1
            assert engine.capabilities.window_checkpoints and not engine.capabilities.can_shift
        else:
            assert llama_cpp.llama_n_seq_max(engine.ctx) == 2
    finally:
        engine.close()


def state(engine: Any) -> bytes:
    """The context's seq state, its window cells in position order (a wrapped ring lists
    them from where it wrapped: the same cells)."""
    return bytes(kvlayout.in_position_order(engine.state_get(), engine.kv_spec()))


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "gpt-oss", "gemma4"])
def test_the_floor_is_what_the_ring_still_holds(family: str, tiny: Callable[[str], Path]) -> None:
    """The context is cut as low as llama.cpp's ring reaches and no lower; below it a held
    window checkpoint is loaded, else the prompt is decoded from the start; each leaves
    exactly the KV of a full prefill. Gemma 2 after a loaded window: the same greedy
    continuation, not always the same bytes (the loaded window sits in other cells of the
    ring, so the attention sums add the same terms in other SIMD lanes: a last-bit
    difference in the KV of the tokens decoded after it, which the tiny model's weights of
    before issue 28.9 showed and its sharper attention rounds away; a restore from disk
    places the window the same way)."""
    path = tiny(family)
    engine, fresh = open_engine(path), open_engine(path)
    n_swa = engine.n_swa
    assert n_swa == 32

    def full_prefill(prompt: list[int]) -> bytes:
        fresh.clear()
        assert fresh.prefill(prompt).decoded == len(prompt)
        return state(fresh)

    try:
        # 200 tokens fit the 256-cell ring: every cut is possible.
        engine.prefill(TOKENS[:200])
        assert engine.window_floor == 0
        assert engine.prefill(TOKENS[:40]).reused == 38
        assert state(engine) == full_prefill(TOKENS[:40])
        # 600 tokens: the ring holds the last 256 positions, and a cut above 600 - 256 +
        # n_swa - 1 keeps a whole window.
        engine.clear()
        engine.prefill(TOKENS[:300])  # a window checkpoint where a regenerate starts: 298
        engine.prefill(TOKENS[:600])
        low = 600 - 256
        assert engine.window_floor == low + n_swa - 1
        floor = engine.window_floor
        result = engine.prefill(TOKENS[: floor + 2])
        assert (result.reused, result.decoded) == (floor, 2)
        assert state(engine) == full_prefill(TOKENS[: floor + 2])
        # Below the floor: the checkpoint at 298 is loaded into the window layers (the
        # full-attention layers keep their cells), and only what follows is decoded.
        assert engine.held_checkpoint(320) == 298
        result = engine.prefill(TOKENS[:330])
        assert (result.reused, result.decoded) == (298, 32)
        loaded = state(engine)
        full = full_prefill(TOKENS[:330])
        if family == "gemma2":  # the bytes may differ in the last bit (see the docstring)
            assert greedy(engine) == greedy(fresh)
        else:
            assert loaded == full
        # Below every checkpoint: decoded from the start, never with a window short of cells.
        engine.prefill(TOKENS[:700])
        assert engine.held_checkpoint(250) == 0 and engine.window_floor > 250
        result = engine.prefill(TOKENS[:252])
        assert (result.reused, result.decoded) == (0, 252)
        assert state(engine) == full_prefill(TOKENS[:252])
    finally:
        engine.close()
        fresh.close()


@pytest.mark.unprobed_repack  # tiny F16 weights: repacking them crashes nothing
@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_with_repacking_on_a_cut_back_is_exact_on_any_cpu(
    family: str, tiny: Callable[[str], Path]
) -> None:
    """Weight repacking set on (the setting; "auto" never repacks on an AMX CPU). On an AMX
    CPU llama.cpp's repacked kernels give other KV for other batch cuts and other ring
    layouts (measured: a cut at the floor differed from a full prefill in 2-58 bytes, and
    the tiny Gemma 3's 64-token greedy reply differed), so there batches are cut on the AMX
    tiles' 16 rows and a wrapped ring is never cut: a window checkpoint is loaded instead.
    Either way the cut-back context holds a full prefill's bytes."""
    from kvchat.engine.probe import has_amx

    path = tiny(family)
    engine, fresh = open_engine(path, repack=True), open_engine(path, repack=True)
    try:
        assert engine.ring_cuts_exact is not has_amx()
        assert engine.batch_align == (16 if has_amx() else 1)
        engine.prefill(TOKENS[:300])  # a window checkpoint where a regenerate starts
        engine.prefill(TOKENS[:600])
        for cut in (377, 330):  # at the floor (375) + 2; below it
            engine.prefill(TOKENS[:cut])
            fresh.clear()
            fresh.prefill(TOKENS[:cut])
            assert state(engine) == state(fresh), cut
            assert greedy(engine) == greedy(fresh)
    finally:
        engine.close()
        fresh.close()


def greedy(engine: Any) -> str:
    """16 greedy tokens from the context, then the context as it was."""
    n = engine.n_tokens
    stats = GenerationStats()
    text = "".join(engine.generate(GenerationParams(temperature=0, max_tokens=16), stats))
    assert stats.generated == 16
    engine.truncate(n)
    return text


def test_checkpoints_stay_held_after_a_save_takes_them(tiny: Callable[[str], Path]) -> None:
    engine = open_engine(tiny("gemma3"))
    try:
        engine.prefill(TOKENS[:300])
        engine.settle(300, TOKENS[:360])
        assert [pos for pos, _ in engine.take_checkpoints()] == [298, 360]
        assert engine.take_checkpoints() == []  # taken once ...
        assert engine.held_checkpoint(1000) == 360  # ... and still held
        engine.prefill(TOKENS[:320])  # a cut below 360 drops it
        assert engine.held_checkpoint(1000) == 318
        engine.clear()
        assert engine.held_checkpoint(1000) == 0
    finally:
        engine.close()


# ------------------------------------------------------------------- turns


def service(home: Path, model: Path, **extra: Any) -> ChatService:
    values: dict[str, Any] = {
        "n_ctx": 1024,
        "n_batch": RING_BATCH,
        "temperature": 0.0,
        "max_tokens": 240,  # longer than the ring's slack: a regenerate is below the floor
        "n_threads": 1,
    }
    return ChatService(load_settings(model=str(model), **(values | extra)), home=home)


def baseline(
    home: Path, tmp: Path, model: Path, turn: Callable[[ChatService], Any], **extra: Any
) -> Any:
    """The same turn with a full prefill, on a copy of ``home``."""
    copy = tmp / "baseline"
    shutil.copytree(home, copy)
    svc = service(copy, model, **extra)
    try:
        return turn(svc)
    finally:
        svc.close()
        shutil.rmtree(copy)


def test_a_regenerate_below_the_floor_loads_the_window_from_ram_then_disk(
    tiny: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    model = tiny("gemma3")
    svc = service(kvhome, model)
    try:
        first = svc.start(FIRST)
        session = first.session_id
        assert first.tokens.generated == 240
        full = baseline(kvhome, tmp_path, model, lambda s: s.regenerate(session, no_restore=True))
        assert full.tokens.decoded == full.tokens.prompt
        # The reply pushed the regenerate's start out of the ring ...
        start = first.tokens.prompt - 2
        assert svc.engine.window_floor > start
        # ... so the hot context loads the window checkpoint held there, in RAM.
        again = svc.regenerate(session)
        assert again.restore.source == "hot", again.restore.reason
        assert (again.tokens.reused, again.tokens.decoded) == (start, 2)
        assert again.reply == full.reply and again.tokens.generated == 240
        # Without it in RAM, the checkpoint on disk serves: exactly as a restore.
        assert svc.engine.window_floor > start
        svc.engine._state.held.clear()  # what a context that took many checkpoints since has
        third = svc.regenerate(session)
        assert third.restore.source == "disk", third.restore.reason
        assert third.tokens.decoded <= 5 and third.reply == full.reply
    finally:
        svc.close()


def test_edit_and_fork_past_the_ring_decode_only_the_new_part(
    tiny: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    model = tiny("gemma3")
    svc = service(kvhome, model, max_tokens=120)
    try:
        first = svc.start(FIRST)
        session = first.session_id
        second = svc.send(session, SECOND)
        svc.send(session, "And the baker?")
        # The hot context can no longer be cut where the branches part.
        assert svc.engine.window_floor > second.tokens.reused
        messages = svc.sessions.messages(session)

        def edit(s: ChatService) -> Any:
            branch = s.sessions.edit(session, messages[2].id, "What did the weaver say?")
            return s.regenerate(branch.id, no_restore=s is not svc)

        def fork(s: ChatService) -> Any:
            child = s.sessions.fork(session, messages[1].id)
            return s.send(child.id, "Who was the miller?", no_restore=s is not svc)

        for turn, shared in ((edit, second.tokens.reused), (fork, second.tokens.reused)):
            full = baseline(kvhome, tmp_path, model, turn, max_tokens=120)
            branched = turn(svc)
            assert branched.restore.source == "disk", branched.restore.reason
            assert branched.restore.donor == session
            assert branched.tokens.reused >= shared - 8
            assert branched.tokens.decoded < 24
            assert full.tokens.decoded == full.tokens.prompt == branched.tokens.prompt
            assert branched.reply == full.reply, turn.__name__
    finally:
        svc.close()


# ------------------------------------------------------------------- Gemma 3 270M

__all__ = ["gemma3_270m"]  # the fixture (tests/e2e/families/test_families.py)

HISTORY = (
    " ".join(
        f"Fact {i}: the river town number {i} trades salt, wool and {i * 3} barrels of cider."
        for i in range(84)
    )
    + " Tell me a short story about one of these towns."
)


@pytest.mark.stress  # 2,000 tokens on Gemma; test_families' Gemma resume past its window runs by default
def test_gemma3_270m_keeps_windows_and_resumes_2000_tokens_exactly(
    gemma3_270m: Path, kvhome: Path, tmp_path: Path
) -> None:
    """The real sliding-window model: its hot KV is the planner's window-sized figure, and a
    2,000-token conversation resumes in a new process, regenerates and forks past its
    window decoding only the new part, with the replies of a full prefill."""
    info = read_gguf(gemma3_270m)
    for swa_full in (False, True):
        with kv_log() as lines:
            engine = open_engine(
                gemma3_270m, n_ctx=4096, n_batch=512, swa_full=swa_full, chat_template="gemma"
            )
        engine.close()
        sizes = [
            (float(m.group(1)) * 2**20, int(m.group(2))) for m in map(KV_LOG.search, lines) if m
        ]
        planned = memory_at(info, 4096, 0, PlanConfig(flash_attn=False, swa_full=swa_full))
        total = sum(size for size, _ in sizes)
        assert total == pytest.approx(planned["host_kv"], abs=0.005 * 2**20 * len(sizes))
        assert sorted(count for _, count in sizes) == ([1024, 4096] if not swa_full else [4096] * 2)
        if not swa_full:
            windowed = total
    # 3 full layers and 15 of 1,024 cells instead of 18 of 4,096: 27 MiB, not 72 MiB.
    assert windowed / total == pytest.approx((3 * 4096 + 15 * 1024) / (18 * 4096), rel=0.01)

    flags = [*FLAGS, "--n-ctx", "4096", "--model", str(gemma3_270m), "--chat-template", "gemma"]
    first = run_cli_here(kvhome, "ask", "--new", HISTORY, "--json", *flags).json
    session = first["session"]
    assert first["tokens"]["prompt"] > 1900
    resumed_home, full_home = copies(kvhome, tmp_path, "resumed", "full-2")
    resumed = run_cli_here(resumed_home, "ask", "--session", session, SECOND, "--json", *flags).json
    full = run_cli_here(
        full_home, "ask", "--session", session, SECOND, "--no-restore", "--json", *flags
    ).json
    assert resumed["restore"]["from"] == "disk", resumed["restore"]["reason"]
    assert 0 < resumed["tokens"]["decoded"] < 64
    assert resumed["tokens"]["prompt"] + 32 > 2000
    assert full["tokens"]["decoded"] == full["tokens"]["prompt"] == resumed["tokens"]["prompt"]
    assert resumed["reply"] == full["reply"]

    extra = {"chat_template": "gemma", "n_ctx": 4096}
    restored, baseline = both_ways(
        resumed_home, tmp_path, gemma3_270m, regenerate(session), **extra
    )
    check_equal(restored, baseline)
    assert restored.tokens.decoded <= 5
    fork = fork_at(session, 1, "What colour was the boat?")
    restored, baseline = both_ways(resumed_home, tmp_path, gemma3_270m, fork, **extra)
    check_equal(restored, baseline)
    assert restored.tokens.reused > 1900 and restored.tokens.decoded < 24
