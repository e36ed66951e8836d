"""`kvchat bench` reads without kvchat's internals: a headline in words before any table,
one line per column under it, an estimate up front and a bar that advances by the plan
(model-free: reports built by hand, a clock that is told the time)."""

from __future__ import annotations

import io

import pytest

from kvchat.bench.progress import (
    BenchPlan,
    ProgressBar,
    Step,
    bar_line,
    clock,
    estimate_line,
    plan_resume_bench,
    prefill_seconds,
)
from kvchat.bench.report import (
    RESUME_COLUMNS,
    WRITE_COLUMNS,
    BenchReport,
    BenchRow,
    WriteRow,
    format_report,
    headline,
    seconds_words,
    times_words,
)

MIB = 2**20


def _row(tokens: int = 4185, resume: float = 21.0, prefill: float = 2312.0) -> BenchRow:
    return BenchRow(
        tokens=tokens,
        snapshot_bytes=92 * MIB,
        restore_ms=14.8,
        limit_ms=17.2,
        restore_over_limit=14.8 / 17.2,
        ttft_resume_ms=resume,
        ttft_prefill_ms=prefill,
        speedup=prefill / resume,
        decoded_resume=25,
        decoded_prefill=tokens + 25,
        restore_blob_ms=10.5,
        chunks_over_blob=14.8 / 10.5,
        restore_ram_ms=6.6,
        ttft_hot_ms=18.0,
        limit_speedup=prefill / (17.2 + 18.0),
        speedup_of_limit=(prefill / resume) / (prefill / (17.2 + 18.0)),
    )


def _report() -> BenchReport:
    report = BenchReport(rows=[_row(1187, 80.0, 2767.0), _row()])
    report.writes = [
        WriteRow(turn, 200 * turn, 200, 4 * MIB, 4 * MIB, 1.0, turn * 4 * MIB)
        for turn in range(1, 9)
    ]
    report.forks = {
        "forks": 5,
        "prefix_tokens": 2132,
        "prefix_bytes": 47 * MIB,
        "branch_bytes": 6 * MIB,
        "disk_bytes": 53 * MIB,
        "whole_blob_bytes": 280 * MIB,
        "disk_over_ideal": 1.0,
        "disk_over_blobs": 53 / 280,
    }
    return report


@pytest.mark.parametrize(
    ("ms", "words"),
    [(21.4, "0.02 s"), (2312, "2.3 s"), (13185, "13 s"), (184_000, "184 s"), (3.0, "0.003 s")],
)
def test_seconds_read_at_a_glance(ms: float, words: str) -> None:
    assert seconds_words(ms) == words


@pytest.mark.parametrize(("ratio", "words"), [(110.1, "110×"), (2.44, "2.4×"), (0.861, "0.86×")])
def test_ratios_read_at_a_glance(ratio: float, words: str) -> None:
    assert times_words(ratio) == words


def test_the_headline_says_the_longest_resume_in_words_first() -> None:
    report = _report()
    lines = headline(report)
    assert lines[0] == (
        "resuming a 4,185-token conversation from disk: first word in 0.02 s instead of "
        "2.3 s — 110× sooner"
    )
    # The restore against llama.cpp's loader says which way it went.
    assert "0.86× the time of llama.cpp's own state loader (17.2 ms), faster than it" in lines[1]
    assert lines[2] == "switching back to it from RAM: its KV in place in 6.6 ms"
    assert lines[3] == (
        "each turn writes only its new tokens' KV: 4.0 MiB a turn over 8 turns, where saving "
        "the whole state would write 32 MiB by the last"
    )
    assert lines[4].startswith("5 branches of one 2,132-token conversation take 53 MiB on disk")
    text = format_report(report)
    # Before any table.
    assert text.index(lines[0]) < text.index("tokens ") and text.startswith(lines[0])


def test_a_restore_slower_than_llama_cpp_says_slower() -> None:
    report = BenchReport(rows=[_row()])
    report.rows[0].restore_over_limit = 1.56
    assert (
        "1.6× the time of llama.cpp's own state loader (17.2 ms), slower than it"
        in (headline(report)[1])
    )


def test_every_column_is_explained_in_one_line_under_its_table() -> None:
    text = format_report(_report())
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("tokens "))
    for name, meaning in RESUME_COLUMNS:
        assert name in header
        (note,) = [line for line in lines if line.endswith(meaning)]
        assert note.split()[0] == name.split()[0]
        assert lines.index(note) > lines.index(header)
    writes_header = next(line for line in lines if line.lstrip().startswith("turn "))
    for name, meaning in WRITE_COLUMNS:
        assert name in writes_header
        assert any(line.endswith(meaning) for line in lines)
    # No column of internals left unexplained.
    for jargon in ("of limit", "limit ", "ratio 1.72"):
        assert jargon not in header


def test_json_keeps_every_figure_and_the_headline() -> None:
    report = _report()
    report.estimate_s, report.elapsed_s = 95.04, 101.26
    data = report.to_json()
    assert data["headline"] == headline(report)
    assert data["estimate_s"] == 95.0 and data["elapsed_s"] == 101.3
    assert len(data["rows"]) == 2 and data["rows"][1]["ttft_prefill_ms"] == 2312.0
    assert len(data["writes"]) == 8 and data["forks"]["forks"] == 5


def test_prefill_time_grows_faster_than_the_tokens() -> None:
    assert prefill_seconds(0, 400.0) == 0
    assert prefill_seconds(1000, 0.0) == 0
    short, long = prefill_seconds(512, 400.0), prefill_seconds(4096, 400.0)
    assert long > 8 * short  # attention over the history
    assert long == pytest.approx(4096 / 400 * 1.5)


def test_the_default_plan_fits_two_minutes_at_this_machines_speed() -> None:
    """At the prompt speed measured on 2 cores (~450 tok/s at 128 tokens), the default
    (1,024 and 4,096 tokens, medians of 3, 8 turns, 5 forks, one layout) is planned under
    2 minutes and the full matrix well over it."""
    default = plan_resume_bench(
        [1024, 4096], 450.0, repeat=3, writes=8, forks=5, other_layout=False
    )
    full = plan_resume_bench(
        [512, 1024, 2048, 4096], 450.0, repeat=5, writes=12, forks=5, other_layout=True
    )
    assert [s.key for s in default.steps] == ["resume-1024", "resume-4096", "writes", "forks"]
    assert default.seconds < 120 < full.seconds
    assert [s.key for s in full.steps][-1] == "layout"
    # Half the speed, twice the time.
    slower = plan_resume_bench([1024, 4096], 225.0, repeat=3, writes=0, forks=0, other_layout=False)
    faster = plan_resume_bench([1024, 4096], 450.0, repeat=3, writes=0, forks=0, other_layout=False)
    assert slower.seconds > 1.7 * faster.seconds


def test_the_estimate_is_said_in_minutes() -> None:
    plan = BenchPlan((Step("a", "a", 60.0), Step("b", "b", 35.4)))
    assert estimate_line(plan, 452.4) == (
        "this will take about 1:35 (2 steps; prompts read at 452 tok/s here)"
    )
    assert clock(3725) == "1:02:05" and clock(-3) == "0:00"


def test_the_bar_line() -> None:
    assert bar_line(0.25, 20, 60, "4,096 tokens") == (
        "[######------------------]  25%  0:20 spent, ~1:00 left  4,096 tokens"
    )
    assert bar_line(1.7, 0, 0, "").startswith("[" + "#" * 24 + "] 100%")


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_bar_advances_by_the_plan_one_line_a_step_off_a_terminal() -> None:
    plan = BenchPlan((Step("a", "first", 30.0), Step("b", "second", 10.0)))
    stream, now = io.StringIO(), _Clock()
    bar = ProgressBar(plan, stream, now=now)
    bar.start()
    bar.step("a")
    now.t += 15
    assert bar.fraction() == pytest.approx(15 / 40)
    now.t += 100  # a step running late stops at its share
    assert bar.fraction() == pytest.approx(30 / 40)
    bar.step("b")
    now.t += 5
    assert bar.fraction() == pytest.approx(35 / 40)
    bar.step("unknown")  # not in the plan: nothing changes
    assert bar.fraction() == pytest.approx(35 / 40)
    bar.say("found: something")
    assert bar.finish() == pytest.approx(120)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[----") and lines[0].endswith("first")
    assert "  75%" in lines[1] and lines[1].endswith("second")
    assert lines[2] == "found: something"
    assert "\x1b" not in stream.getvalue()  # no terminal codes into a file or a pipe
