"""The families of 2026: hybrid and recurrent models, and sliding windows with
attention sinks, as tiny random-weight GGUFs (``tests/tiny_models.write_family``).

llama.cpp 0.3.36 runs every one of these families (``RUNS``). For the recurrent ones
(Mamba 2, LFM2's short convolutions, Jamba, Qwen 3.5 and Qwen3-Next's Gated DeltaNet,
Granite 4 hybrid, Falcon-H1, Nemotron-H: all beside attention but Mamba 2) kvchat never
places a recurrent state where it has none: a state restored from disk holds its last
position only, so a regenerate after a restore is a full prefill with the reason, while
in the hot context the engine's own checkpoints (llama.cpp's partial state, taken where the
reply and a regenerate start) make a regenerate decode two tokens. The sliding-window ones
(gpt-oss with sinks, Gemma 4) resume, regenerate and fork like Gemma 3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from kvchat.config import load_settings
from kvchat.engine import EngineConfig, GenerationParams, GenerationStats
from kvchat.planner import kv_bytes_per_token, read_gguf
from kvchat.planner.plan import (
    PlanConfig,
    format_plan,
    make_plan,
    memory_at,
    state_bytes_per_token,
)
from kvchat.service.chat import ChatService
from tests.conftest import run_cli_here
from tests.e2e.families.test_families import (
    FIRST,
    FLAGS,
    FORKED,
    GENERATE,
    KV_LOG,
    SECOND,
    both_ways,
    check_equal,
    copies,
    fork_at,
    kv_log,
    regenerate,
)
from tests.tiny_models import RUNS, write_family

RECURRENT = (
    "mamba2",
    "lfm2",
    "jamba",
    "qwen35",
    "qwen3next",
    "granitehybrid",
    "falcon-h1",
    "nemotron_h",
)
WINDOWED = ("gpt-oss", "gemma4")
# The architectures issue 24 names: each is either run or listed with its reason.
NAMED = {"qwen35", "lfm2", "granitehybrid", "nemotron_h", "falcon-h1", "jamba", "mamba2"}
NAMED |= {"gemma4", "gpt-oss"}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    folder = tmp_path_factory.mktemp("tiny-families")

    def get(arch: str) -> Path:
        path = folder / f"{arch}.gguf"
        if not path.exists():
            write_family(arch, path)
        return path

    return get


def open_engine(path: Path, **extra: Any) -> Any:
    from kvchat.engine.llama import LlamaEngine

    values: dict[str, Any] = {"n_ctx": 1024, "n_batch": 64, "n_threads": 1}
    return LlamaEngine(EngineConfig(path, **(values | extra)))


def test_every_named_family_runs_here() -> None:
    assert set(RUNS) == NAMED | {"qwen3next"}


@pytest.mark.parametrize("arch", RUNS)
def test_the_family_runs_and_kvchat_knows_its_state(
    arch: str, family: Callable[[str], Path]
) -> None:
    path = family(arch)
    with kv_log() as lines:
        engine = open_engine(path)
    try:
        result = engine.prefill([100 + (i * 37) % 4000 for i in range(60)])
        assert (result.reused, result.decoded) == (0, 60)
        before = engine.state_size()
        stats = GenerationStats()
        "".join(engine.generate(GenerationParams(temperature=0, max_tokens=8), stats))
        assert stats.generated == 8 and engine.n_tokens == 68
        # The state grows by the planner's bytes per token (0 for Mamba 2: no KV at all).
        info = read_gguf(path)
        growth = (engine.state_size() - before) / 8
        assert growth == state_bytes_per_token(info, kv_bytes_per_token(info))
        # llama.cpp allocates the planner's KV: the attention layers' (none for Mamba 2),
        # sliding-window layers window-sized.
        sizes = [float(m.group(1)) * 2**20 for m in map(KV_LOG.search, lines) if m]
        planned = memory_at(info, 1024, 0, PlanConfig(flash_attn=False, n_ubatch=64))
        # (llama.cpp logs MiB with two decimals: up to 0.005 MiB off a line)
        assert sum(sizes) == pytest.approx(planned["host_kv"], abs=0.0051 * 2**20 * len(sizes))
        assert len(sizes) == (0 if arch == "mamba2" else 2 if arch in WINDOWED else 1)
        if arch in RECURRENT:
            assert engine.recurrent and not engine.can_shift()
            assert "recurrent" in (engine.chunk_problem() or "")
            # Its context can be cut only at its end: the floor is where it stands.
            assert engine.window_floor == engine.restore_floor(68) == 68
            # The planner knows the recurrent state's fixed size: llama.cpp's partial state.
            partial = llama_cpp.llama_state_seq_get_size_ext(
                engine.ctx, 0, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            )
            assert info.recurrent_state_bytes == partial > 0
            plan = format_plan(make_plan(info))
            assert f"a fixed state of {partial:,} bytes per sequence" in plan
        else:
            assert engine.interleaved and not engine.recurrent
            assert engine.chunk_problem() is None  # chunked, with window pieces
    finally:
        engine.close()


# ------------------------------------------------------------------- recurrent state


def service(home: Path, model: Path, **extra: Any) -> ChatService:
    values: dict[str, Any] = {
        "n_ctx": 1024,
        "temperature": 0.0,
        "max_tokens": GENERATE,
        "n_threads": 1,
    }
    return ChatService(load_settings(model=str(model), **(values | extra)), home=home)


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_recurrent_state_is_never_placed_without_a_checkpoint(
    arch: str, family: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    model = family(arch)
    flags = [*FLAGS, "--n-ctx", "1024", "--model", str(model)]
    first = run_cli_here(kvhome, "ask", "--new", FIRST, "--json", *flags).json
    session = first["session"]
    assert "recurrent" in (first["snapshot"]["whole_reason"] or "")

    # A new command (a new service and engine) resumes from the whole state and decodes only the new message ...
    resumed_home, full_home = copies(kvhome, tmp_path, "resumed", "full-2")
    resumed = run_cli_here(resumed_home, "ask", "--session", session, SECOND, "--json", *flags).json
    full = run_cli_here(
        full_home, "ask", "--session", session, SECOND, "--no-restore", "--json", *flags
    ).json
    assert resumed["restore"]["from"] == "disk", resumed["restore"]["reason"]
    assert 0 < resumed["tokens"]["decoded"] < 64
    assert full["tokens"]["decoded"] == full["tokens"]["prompt"] == resumed["tokens"]["prompt"]
    assert resumed["reply"] == full["reply"]

    # ... but a saved state holds its last position only: a regenerate after a restore is
    # a full prefill, and says why ...
    restored, baseline = both_ways(resumed_home, tmp_path, model, regenerate(session))
    assert restored.restore.source == "none"
    assert "recurrent" in (restored.restore.reason or "")
    assert "cannot be cut back" in (restored.restore.reason or "")
    assert restored.tokens.decoded == restored.tokens.prompt
    assert restored.reply == baseline.reply
    # ... and so is a fork at an earlier message.
    restored, baseline = both_ways(resumed_home, tmp_path, model, fork_at(session, 1, FORKED))
    assert restored.restore.source == "none" and restored.tokens.reused == 0
    assert restored.reply == baseline.reply

    # In the hot context the engine's checkpoint at the regenerate's start serves: the
    # first regenerate here is a full prefill (restored state), the second decodes two
    # tokens and replies as the full prefill did.
    svc = service(resumed_home, model)
    try:
        again = svc.regenerate(session)
        assert again.restore.source == "none" and again.tokens.reused == 0
        hot = svc.regenerate(session)
        assert hot.restore.source == "hot", hot.restore.reason
        assert (hot.tokens.reused, hot.tokens.decoded) == (hot.tokens.prompt - 2, 2)
        assert hot.reply == again.reply
    finally:
        svc.close()


# ------------------------------------------------------------------- windows with sinks


@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_window_families_resume_branch_and_equal_a_full_prefill(
    arch: str, family: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    model = family(arch)
    flags = [*FLAGS, "--n-ctx", "1024", "--model", str(model)]
    first = run_cli_here(kvhome, "ask", "--new", FIRST, "--json", *flags).json
    session = first["session"]
    assert first["snapshot"]["whole_reason"] is None
    assert first["snapshot"]["chunks_written"] > 0 and first["snapshot"]["checkpoints_written"]

    resumed_home, full_home = copies(kvhome, tmp_path, "resumed", "full-2")
    resumed = run_cli_here(resumed_home, "ask", "--session", session, SECOND, "--json", *flags).json
    full = run_cli_here(
        full_home, "ask", "--session", session, SECOND, "--no-restore", "--json", *flags
    ).json
    assert resumed["restore"]["from"] == "disk", resumed["restore"]["reason"]
    assert 0 < resumed["tokens"]["decoded"] < 64
    assert full["tokens"]["decoded"] == full["tokens"]["prompt"] == resumed["tokens"]["prompt"]
    assert resumed["reply"] == full["reply"]
    assert resumed["tokens"]["prompt"] > 2 * 32  # past the window

    restored, baseline = both_ways(resumed_home, tmp_path, model, regenerate(session))
    check_equal(restored, baseline)
    assert restored.tokens.decoded <= 5
    restored, baseline = both_ways(resumed_home, tmp_path, model, fork_at(session, 1, FORKED))
    check_equal(restored, baseline)
    assert restored.restore.donor == session
    assert restored.tokens.reused > 32 and restored.tokens.decoded < 24
