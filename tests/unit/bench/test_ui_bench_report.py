"""The UI bench's report states each bound it checks (model-free)."""

from __future__ import annotations

from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)


def test_ui_bench_report_states_each_bound() -> None:
    from kvchat.bench.ui_report import Switch, UiReport

    report = UiReport(first_paint_ms=420, jump_ms=250, echo_ms=[10.0] * 19 + [80.0])
    report.switches = [Switch("disk", 4000, 90.0, 120.0, 60.0, 30.0)]
    report.machine = {"cores": 2}
    data = report.to_json()
    bounds = data["bounds"]
    assert bounds["first_paint_ms"] == {"bound": 500.0, "measured": 420.0, "met": True}
    assert bounds["switch_over_restore_ms"]["met"] is True
    assert bounds["jump_ms"]["met"] is False
    assert bounds["echo_p95_ms"] == {"bound": 50.0, "measured": 10.0, "met": True}
    assert data["echo_max_ms"] == 80.0 and data["echo_keys"] == 20
