"""The GPU proof's decisions with a fake NVML (no GPU here): when it runs and why not, the
exactness matrix's cases, what NVML's figures become, when a VRAM plan held, and when a
6 GiB plan is tried. The proof itself (scripts/gpu_proof.py) has not yet run on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvchat.bench.gpu_proof import (
    GIB,
    SCHEMA,
    GpuReading,
    PlanCheck,
    exactness_cases,
    measured_use,
    preflight,
    read_gpu,
    report_skeleton,
    six_gb_case,
    six_gb_held,
)


@dataclass
class _Memory:
    total: int
    used: int
    free: int


class FakeNvml:
    """pynvml's calls the proof makes, answering from fields; ``fail`` names one to raise."""

    def __init__(
        self, *, count: int = 1, total: int = 24 * GIB, used: int = GIB, name: Any = b"RTX 4090"
    ) -> None:
        self.count, self.total, self.used, self.name = count, total, used, name
        self.fail: str | None = None
        self.shut = 0

    def _maybe_fail(self, call: str) -> None:
        if self.fail == call:
            raise RuntimeError(f"NVMLError: {call} failed")

    def nvmlInit(self) -> None:
        self._maybe_fail("init")

    def nvmlShutdown(self) -> None:
        self.shut += 1

    def nvmlDeviceGetCount(self) -> int:
        self._maybe_fail("count")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        return object()

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> _Memory:
        self._maybe_fail("memory")
        return _Memory(self.total, self.used, self.total - self.used)

    def nvmlDeviceGetName(self, handle: object) -> Any:
        return self.name


def test_a_reading_is_typed_and_nvml_is_shut_down() -> None:
    nvml = FakeNvml(name=b"NVIDIA GeForce RTX 4090\n")
    reading = read_gpu(nvml)
    assert reading == GpuReading("NVIDIA GeForce RTX 4090", 24 * GIB, GIB, 23 * GIB)
    assert nvml.shut == 1


@pytest.mark.parametrize(
    ("nvml", "says"),
    [
        (None, "no NVML"),
        (FakeNvml(count=0), "NVML sees no GPU"),
        (FakeNvml(used=30 * GIB), "impossible memory figures"),
    ],
)
def test_no_reading_is_one_line(nvml: Any, says: str) -> None:
    reading = read_gpu(nvml)
    assert isinstance(reading, str) and says in reading
    assert preflight(reading, True) == reading


@pytest.mark.parametrize("call", ["init", "count", "memory"])
def test_an_nvml_error_is_one_line(call: str) -> None:
    nvml = FakeNvml()
    nvml.fail = call
    reading = read_gpu(nvml)
    assert isinstance(reading, str) and "NVMLError" in reading and "\n" not in reading


def test_a_cpu_build_of_llama_cpp_python_is_said_with_the_fix() -> None:
    reading = read_gpu(FakeNvml())
    assert preflight(reading, True) is None
    reason = preflight(reading, False)
    assert reason is not None and "-DGGML_CUDA=on" in reason


def test_the_matrix_runs_what_llama_cpp_can_and_lists_the_rest() -> None:
    cases = exactness_cases()
    assert len(cases) == 6
    run = {(c.type_k, c.flash_attn) for c in cases if c.run}
    assert run == {("f16", True), ("f16", False), ("q8_0", True), ("q4_0", True)}
    skipped = [c for c in cases if not c.run]
    assert all("needs flash attention" in (c.skip_reason or "") for c in skipped)


def test_a_plan_holds_within_its_slack_and_not_beyond() -> None:
    before = GpuReading("g", 24 * GIB, GIB, 23 * GIB)
    after = GpuReading("g", 24 * GIB, 3 * GIB, 21 * GIB)
    assert measured_use(before, after) == 2 * GIB
    assert measured_use(after, before) == 0  # never negative
    assert PlanCheck("m", 2 * GIB, 2 * GIB).held
    assert PlanCheck("m", 2 * GIB, int(2.7 * GIB)).held  # +15% and 512 MiB of CUDA's own
    assert not PlanCheck("m", 2 * GIB, 3 * GIB).held
    assert not PlanCheck("m", 2 * GIB, 0).held  # nothing measured proves nothing
    assert PlanCheck("m", 2 * GIB, 3 * GIB).to_json()["over_plan"] == 1.5


def test_a_six_gib_plan_is_tried_on_a_larger_card_with_room() -> None:
    assert six_gb_case(GpuReading("g", 24 * GIB, GIB, 23 * GIB)) is None
    small = six_gb_case(GpuReading("g", 6 * GIB, 0, 6 * GIB))
    assert small is not None and "6 GiB or less" in small
    busy = six_gb_case(GpuReading("g", 24 * GIB, 20 * GIB, 4 * GIB))
    assert busy is not None and "4.0 GiB free" in busy
    assert six_gb_held(6 * GIB) and not six_gb_held(6 * GIB + 1) and not six_gb_held(0)


def test_the_report_says_why_it_did_not_run() -> None:
    report = report_skeleton("no NVML (pip install nvidia-ml-py on the GPU machine)", None)
    assert report["schema"] == SCHEMA and report["ran"] is True  # a reason is passed apart
    not_run = report_skeleton("no GPU", "no GPU")
    assert not_run["ran"] is False and not_run["reason"] == "no GPU"
    assert not any(case["run"] for case in not_run["exactness"])
    assert set(not_run) == {
        "schema",
        "ran",
        "reason",
        "gpu",
        "exactness",
        "plans",
        "six_gb",
        "peers",
    }
