"""A child process for ``kvchat bench --peers``: a LlamaDiskCache state loaded into a
context of another KV type, as llama-cpp-python would load it. It prints one JSON line;
if llama.cpp aborts, the parent sees the signal instead.

``python -m kvchat.bench.peer_child CACHE_DIR MODEL N_CTX THREADS KV_TYPE``
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main(argv: list[str]) -> int:
    import llama_cpp
    from llama_cpp import LlamaDiskCache

    cache_dir, model, n_ctx, threads, kv = argv
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv]
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=int(n_ctx),
        n_threads=int(threads),
        type_k=kv_type,
        type_v=kv_type,
        flash_attn=True,
        verbose=False,
    )
    cache = LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=64 << 30)
    key = next(iter(cache.cache.iterkeys()), None)
    if key is None:
        print(json.dumps({"outcome": "none", "why": "no state in the cache"}))
        return 0
    with contextlib.redirect_stderr(io.StringIO()):
        state = cache[list(key)]
    try:
        llm.load_state(state)
    except Exception as exc:  # what llama-cpp-python raises is what a user sees
        print(json.dumps({"outcome": "rejected", "why": f"{type(exc).__name__}: {exc}"}))
        return 0
    out = []
    for token in llm.generate(list(key), top_k=1, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) >= 8:
            break
    text = llm.detokenize(out).decode("utf-8", errors="replace")
    print(json.dumps({"outcome": "accepted", "why": f"then replied {text!r}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
