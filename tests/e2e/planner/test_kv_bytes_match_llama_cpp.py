"""The planner's KV figures are what llama.cpp really allocates for the bundled model (its
own log line, and the growth of the per-sequence state)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest

from kvchat.engine.llama import weight_repack
from kvchat.planner import (
    kv_bytes_per_token,
    read_gguf,
)
from kvchat.planner.plan import (
    MiB,
)
from tests.unit.planner.test_planner import BUNDLED, needs_bundled

GGML = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data dir (and so its own models dir)."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# ------------------------------------------------------------------ against llama.cpp

KV_LOG = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*"
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)


def measure_llama_cpp(kv_type: str, repack: bool, n_ctx: int = 512) -> dict[str, float]:
    """KV bytes per token as llama.cpp allocates them, two ways.

    ``log``: its "llama_kv_cache: size = … (N cells …) K (…): x MiB, V (…): y MiB" line;
    ``state``: growth of ``llama_state_seq_get_size`` per evaluated token (the KV rows plus
    12 bytes of cell metadata).
    """
    assert BUNDLED is not None
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        with weight_repack(repack):
            llm = llama_cpp.Llama(
                model_path=str(BUNDLED),
                n_ctx=n_ctx,
                n_batch=64,
                n_threads=2,
                type_k=GGML[kv_type],
                type_v=GGML[kv_type],
                flash_attn=kv_type != "f16",
                verbose=False,
            )
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    try:
        tokens = llm.tokenize(
            b"The quick brown fox jumps over the lazy dog, then naps "
            b"in the warm afternoon sun for a while."
        )[:16]
        assert len(tokens) == 16
        llm.eval(tokens[:8])
        first = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
        llm.eval(tokens[8:])
        second = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    finally:
        llm.close()
    match = next(m for m in (KV_LOG.search(line) for line in lines) if m)
    cells, layers = int(match.group(2)), int(match.group(3))
    assert (match.group(4), match.group(6)) == (kv_type, kv_type)
    kv_mib = float(match.group(5)) + float(match.group(7))
    return {
        "cells": cells,
        "layers": layers,
        "log": kv_mib * MiB / cells,
        "state": (second - first) / 8,
    }


@needs_bundled
@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_kv_bytes_match_llama_cpp(kv_type: str, probed_repack: Callable[[Path], bool]) -> None:
    assert BUNDLED is not None
    planned = kv_bytes_per_token(read_gguf(BUNDLED), kv_type).total
    real = measure_llama_cpp(kv_type, probed_repack(BUNDLED))
    assert real["cells"] == 512 and real["layers"] == 30
    assert real["log"] == pytest.approx(planned, rel=0.02)
    assert real["state"] == pytest.approx(planned, rel=0.02)
    # The per-token state is exactly the KV rows plus llama.cpp's 12 bytes of cell metadata.
    assert real["state"] == planned + 12
