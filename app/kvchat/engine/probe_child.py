"""The probe's child process: load a model as asked, run what a turn runs, measure threads.

Run by :func:`kvchat.engine.probe.run_child` as ``python -m kvchat.engine.probe_child JSON``.
It prints one JSON line: ``{"ok": true, "speeds": {...}}``, or ``{"ok": false, "error": ...}``
with exit status 1. A native crash kills it by a signal, which the parent reads.

``KVCHAT_TEST_PROBE_CRASH`` (tests only) names options that make the child kill itself by
SIGSEGV once the model is loaded, as llama.cpp's AMX kernels do on the first decode:
``repack``, ``flash_attn``, ``gpu`` (comma-separated) or ``always``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from kvchat.engine.probe import PROBE_CTX, PROBE_GENERATE, PROBE_PROMPT
from kvchat.system import current as current_system

TEST_CRASH_ENV = "KVCHAT_TEST_PROBE_CRASH"
# Plain text whose tokens fill the prompt batch (repeated as needed).
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the river runs past old stone "
    "bridges, green fields and quiet villages under a grey autumn sky."
)


def _test_crash(request: dict[str, Any]) -> None:
    wanted = {part.strip() for part in os.environ.get(TEST_CRASH_ENV, "").split(",")}
    hit = (
        "always" in wanted
        or ("repack" in wanted and request["repack"])
        or ("flash_attn" in wanted and request["flash_attn"])
        or ("gpu" in wanted and request["n_gpu_layers"] != 0)
    )
    if hit:
        current_system().crash_self()


def _watch_parent(parent: int) -> None:
    """End this child when the kvchat that started it is gone (where the kernel does not
    do it for us: see ``kvchat.system``'s ``child_options``)."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    from kvchat.engine.api import EngineConfig, GenerationParams, GenerationStats
    from kvchat.engine.llama import LlamaEngine
    from kvchat.engine.openai_wire import loads
    from kvchat.errors import KvchatError

    request = loads(argv[0], "the probe request", cap=65536)
    if isinstance(request.get("parent"), int):
        _watch_parent(request["parent"])
    config = EngineConfig(
        Path(request["model_path"]),
        n_ctx=PROBE_CTX,
        n_batch=request["n_batch"],
        n_threads=request["n_threads"],
        n_gpu_layers=request["n_gpu_layers"],
        type_k=request["type_k"],
        type_v=request["type_v"],
        flash_attn=request["flash_attn"],
        repack=request["repack"],
    )
    try:
        engine = LlamaEngine(config)
    except KvchatError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    _test_crash(request)
    try:
        words = engine.tokenize(PROBE_TEXT) or [0]
        prompt = (words * (PROBE_PROMPT // len(words) + 1))[: min(PROBE_PROMPT, config.n_batch)]
        engine.prefill(prompt)
        stats = GenerationStats()
        params = GenerationParams(temperature=0, max_tokens=PROBE_GENERATE)
        for _ in engine.generate(params, stats):
            pass
        engine.clear()
        speeds = engine.measure_threads(request["thread_counts"])
    except KvchatError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    finally:
        engine.close()
    print(json.dumps({"ok": True, "speeds": speeds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
