"""The GPU proof in one command, for the first machine with an NVIDIA GPU:

    python scripts/gpu_proof.py [--out gpu-proof.json] [--model PATH ...] [--no-peers]

Needs a CUDA build of llama-cpp-python and nvidia-ml-py (pynvml); no network. It runs:
the exactness matrix (KV f16/q8_0/q4_0 × flash attention on/off, all layers on the GPU:
the state after a restore hashes equal to a full prefill's, and the greedy reply after it
equals a full prefill's), the planner's VRAM figure against NVML's measured use for the
bundled model and each --model, a 6 GiB plan on a larger card (measured ≤ 6 GiB), and
``kvchat bench --peers`` on the GPU. One JSON report (schema: kvchat.bench.gpu_proof).
Where it cannot run (no GPU, no NVML, a CPU build) the report says why and the exit is 3.
It has not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _exactness(case: Any, settings: Any) -> dict[str, Any]:
    import xxhash

    from kvchat.bench.peers import _chat, _kvchat_turn
    from kvchat.bench.runs import build_history
    from kvchat.service.chat import open_service

    changed = settings.model_copy(
        update={
            "type_k": case.type_k,
            "type_v": case.type_v,
            "flash_attn": case.flash_attn,
            "n_gpu_layers": -1,
        }
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-gpu-proof-") as scratch,
        open_service(changed, home=Path(scratch)) as service,
    ):
        engine = service.load_engine()
        tiers = service.host.tiers
        session_id = build_history(service, 512)
        service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
        row = tiers.snapshot(session_id)
        assert row is not None
        tiers.mark_hot(None)
        tiers.warm.clear()
        restored = service.make_hot(session_id)
        restored_hash = xxhash.xxh3_128_hexdigest(bytes(engine.state_get()))
        tiers.mark_hot(None)
        engine.clear()
        engine.prefill(list(row.token_ids))
        prefill_hash = xxhash.xxh3_128_hexdigest(bytes(engine.state_get()))
        chat = _chat(service, session_id)
        _, after_restore, decoded_resume = _kvchat_turn(service, session_id, chat, "disk")
        _, after_prefill, decoded_prefill = _kvchat_turn(service, session_id, chat, None)
        return {
            "restored_from": restored.source,
            "tokens": row.n_tokens,
            "state_hash_equal": restored_hash == prefill_hash,
            "greedy_equal": after_restore == after_prefill,
            "decoded_resume": decoded_resume,
            "decoded_prefill": decoded_prefill,
        }


def _plan_check(settings: Any, nvml: Any, label: str) -> dict[str, Any]:
    from kvchat.bench.gpu_proof import GpuReading, PlanCheck, measured_use, read_gpu
    from kvchat.planner.defaults import plan_defaults
    from kvchat.planner.model_lookup import model_path
    from kvchat.service.chat import open_service

    path = model_path(settings)
    choice = plan_defaults(settings, path)
    before = read_gpu(nvml)
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-gpu-proof-") as scratch,
        open_service(choice.apply(settings), home=Path(scratch)) as service,
    ):
        service.load_engine()
        after = read_gpu(nvml)
    if not isinstance(before, GpuReading) or not isinstance(after, GpuReading):
        return {"model": label, "error": str(after if isinstance(before, GpuReading) else before)}
    check = PlanCheck(label, int(choice.vram_total or 0), measured_use(before, after))
    return {**check.to_json(), "plan": choice.to_json()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-proof.json")
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args(argv)

    from kvchat.bench.gpu_proof import (
        exactness_cases,
        preflight,
        read_gpu,
        report_skeleton,
        six_gb_case,
        six_gb_held,
    )
    from kvchat.config import Settings
    from kvchat.planner.defaults import gpu_offload_supported

    nvml = _nvml()
    reading = read_gpu(nvml)
    reason = preflight(reading, gpu_offload_supported())
    report = report_skeleton(reading, reason)
    if reason is None:
        settings = Settings()
        for entry, case in zip(report["exactness"], exactness_cases(), strict=True):
            if case.run:
                print(
                    f"exactness: KV {case.type_k}, flash attention {case.flash_attn}…",
                    file=sys.stderr,
                )
                entry.update(_exactness(case, settings))
        report["plans"].append(_plan_check(settings, nvml, "bundled"))
        for model in args.model:
            report["plans"].append(
                _plan_check(settings.model_copy(update={"model": model}), nvml, model)
            )
        skip = six_gb_case(reading)  # type: ignore[arg-type]
        if skip is None:
            six = _plan_check(settings.model_copy(update={"vram": "6GiB"}), nvml, "6 GiB plan")
            six["run"], six["skip_reason"] = True, None
            six["held"] = six_gb_held(int(six.get("measured_bytes", 0)))
            report["six_gb"] = six
        else:
            report["six_gb"] = {"run": False, "skip_reason": skip}
        if not args.no_peers:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvchat",
                    "bench",
                    "--peers",
                    "--json",
                    "--gpu-layers",
                    "-1",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ},
            )
            try:
                report["peers"] = json.loads(proc.stdout)
            except ValueError:
                report["peers"] = {"error": proc.stderr.strip().splitlines()[-1:]}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}" + (f": not run: {reason}" if reason else ""), file=sys.stderr)
    return 3 if reason else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
