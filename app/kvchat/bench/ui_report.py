"""``kvchat bench --ui``'s report: the figures, the issue's bounds, JSON and text."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

# The bounds, in ms (switch: over the restore time of that switch).
BOUNDS = {"first_paint_ms": 500.0, "switch_over_restore_ms": 50.0, "jump_ms": 200.0}
ECHO_P95_BOUND_MS = 50.0
LIMITS = {**BOUNDS, "echo_p95_ms": ECHO_P95_BOUND_MS}
AT_MOST = {"switch_over_restore_ms"}  # met at the bound itself (≤); the others below it (<)
LONG_SESSION = 300  # messages in the session a search jump lands in


def verdicts(measured: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each figure against its bound in :data:`LIMITS`: the bound, the figure (None: not
    measured, never met) and whether it is met."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in measured.items():
        bound = LIMITS[name]
        met = value is not None and (value <= bound if name in AT_MOST else value < bound)
        shown = round(value, 1) if value is not None else None
        out[name] = {"bound": bound, "measured": shown, "met": met}
    return out


@dataclass
class Switch:
    """One session switch: when it was drawn, and its restore."""

    source: str  # where the KV came from: disk, ram, hot, none
    tokens: int
    drawn_ms: float  # Enter → visible messages drawn, input focused
    ready_ms: float  # Enter → restore done and shown (KV ready)
    restore_ms: float  # the restore itself, as the service timed it
    over_restore_ms: float  # drawn_ms − restore_ms

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class UiReport:
    machine: dict[str, Any] = field(default_factory=dict)
    import_ms: float = 0.0  # import kvchat.tui.app in a fresh process
    first_paint_ms: float = 0.0  # process start → first frame (median of runs)
    first_paint_app_ms: float = 0.0  # KvchatApp() → first frame
    first_paint_command_ms: float = 0.0  # the same with the `kvchat` command's imports and Settings
    switches: list[Switch] = field(default_factory=list)
    jump_ms: float = 0.0
    jump_messages: int = 0
    echo_ms: list[float] = field(default_factory=list)

    @property
    def echo_p95_ms(self) -> float:
        return _percentile(self.echo_ms, 95)

    @property
    def switch_over_restore_ms(self) -> float:
        return max((s.over_restore_ms for s in self.switches), default=0.0)

    def bounds(self) -> dict[str, dict[str, Any]]:
        return verdicts(
            {
                "first_paint_ms": self.first_paint_ms,
                "switch_over_restore_ms": self.switch_over_restore_ms,
                "jump_ms": self.jump_ms,
                "echo_p95_ms": self.echo_p95_ms,
            }
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "import_ms": round(self.import_ms, 1),
            "first_paint_ms": round(self.first_paint_ms, 1),
            "first_paint_app_ms": round(self.first_paint_app_ms, 1),
            "first_paint_command_ms": round(self.first_paint_command_ms, 1),
            "switches": [s.to_json() for s in self.switches],
            "switch_ms": round(statistics.median([s.drawn_ms for s in self.switches]), 1)
            if self.switches
            else None,
            "switch_over_restore_ms": round(self.switch_over_restore_ms, 1),
            "jump_ms": round(self.jump_ms, 1),
            "jump_messages": self.jump_messages,
            "echo_keys": len(self.echo_ms),
            "echo_p50_ms": round(_percentile(self.echo_ms, 50), 1),
            "echo_p95_ms": round(self.echo_p95_ms, 1),
            "echo_max_ms": round(max(self.echo_ms, default=0.0), 1),
            "bounds": self.bounds(),
        }


def _percentile(values: list[float], pct: float) -> float:
    """The nearest-rank percentile: the smallest value with ``pct`` % of them at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(pct / 100 * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def format_ui_report(report: UiReport) -> str:
    from kvchat.bench.runs import machine_line

    data = report.to_json()
    lines = [machine_line(report.machine), ""]
    lines.append(
        f"first paint: {report.first_paint_ms:,.0f} ms from process start "
        f"(import {report.import_ms:,.0f} ms, app → frame {report.first_paint_app_ms:,.0f} ms); "
        f"via the kvchat command {report.first_paint_command_ms:,.0f} ms"
    )
    tokens = report.machine.get("session_tokens", 0)
    lines.append(f"session switches ({tokens:,}-token sessions):")
    for s in report.switches:
        lines.append(
            f"  {s.source:>4}: drawn {s.drawn_ms:6,.0f} ms · restore {s.restore_ms:6,.1f} ms "
            f"(drawn − restore {s.over_restore_ms:+6,.0f} ms) · KV ready {s.ready_ms:6,.0f} ms"
        )
    lines.append(
        f"search jump (message 5 of {LONG_SESSION}): {report.jump_ms:,.0f} ms, "
        f"{report.jump_messages} messages mounted"
    )
    lines.append(
        f"keystroke echo while a reply streams: p50 {data['echo_p50_ms']:,.0f} ms, "
        f"p95 {data['echo_p95_ms']:,.0f} ms, max {data['echo_max_ms']:,.0f} ms "
        f"({data['echo_keys']} keys)"
    )
    lines.append("")
    lines += verdict_lines(data["bounds"])
    return "\n".join(lines)


def verdict_lines(bounds: dict[str, dict[str, Any]]) -> list[str]:
    """One line per bound of :func:`verdicts`: the figure, its bound, met or not."""
    lines = []
    for name, b in bounds.items():
        verdict = "met" if b["met"] else "NOT met"
        shown = f"{b['measured']:>8,.1f} ms" if b["measured"] is not None else "     n/a   "
        op = "≤" if name in AT_MOST else "<"
        lines.append(f"  {name:<24} {shown}  bound {op} {b['bound']:,.0f} ms  {verdict}")
    return lines
