"""``kvchat bench --json``: per size the hot turn, the limit of the
speedup and the speedup as a fraction of it; chunk restores against llama.cpp's loader in
both V layouts; the machine the figures come from. Counts and keys are asserted, never
timings (speed is what the bench itself reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROW_KEYS = {
    "tokens",
    "restore_ms",
    "limit_ms",
    "restore_over_limit",
    "ttft_resume_ms",
    "ttft_hot_ms",
    "ttft_prefill_ms",
    "speedup",
    "limit_speedup",
    "speedup_of_limit",
    "chunks_over_blob",
    "restore_ram_ms",
    "decoded_resume",
    "decoded_prefill",
}


@pytest.mark.stress  # --full; the default run's bench is the words test below
def test_e2e_bench_json_reports_the_limit_and_both_layouts(kvhome: Path, cli) -> None:
    result = cli(
        kvhome, "bench", "--full", "--json", "--sizes", "300", "--repeat", "1", "--no-tiers"
    )
    report = result.json
    (row,) = report["rows"]
    assert ROW_KEYS <= set(row)
    # --json: the headline and the estimate are in the report; stderr has neither.
    assert report["headline"][0].startswith(f"resuming a {row['tokens']:,}-token conversation")
    assert report["estimate_s"] > 0 and report["elapsed_s"] > 0
    assert "this will take" not in result.stderr and "[#" not in result.stderr
    # The resume decodes only the new message; the baseline the whole history.
    assert 0 < row["decoded_resume"] < 60
    # Exactly: the baseline decodes the whole prompt, the resume all but the restored history.
    assert row["decoded_prefill"] - row["decoded_resume"] == row["tokens"]
    assert row["limit_speedup"] > 0 and row["speedup"] > 0
    assert row["speedup_of_limit"] == pytest.approx(row["speedup"] / row["limit_speedup"], rel=0.01)
    layouts = {entry["flash_attn"]: entry for entry in report["layouts"]}
    assert set(layouts) == {False, True}, report["layouts_note"]
    for flash_attn, entry in layouts.items():
        assert entry["v_transposed"] is not flash_attn
        assert entry["restore_over_limit"] > 0 and entry["tokens"] == row["tokens"]
    machine = report["machine"]
    assert machine["cpu_cores"] >= 1 and isinstance(machine["gpu"], bool)
    assert len(machine["load_avg"]) == 3 and len(machine["load_avg_end"]) == 3
    # Tokens/s with the threads the probe chose against the physical cores, in this run.
    threads = report["threads"]
    assert threads["chosen"] == machine["threads"]
    assert set(threads["speeds"]) == {str(threads["chosen"]), str(threads["physical"])}
    assert all(row["generate"] > 0 and row["prefill"] > 0 for row in threads["speeds"].values())


@pytest.mark.stress  # a corner of --full; the default run measures both layouts above
def test_e2e_bench_with_a_quantized_v_cache_says_why_one_layout(kvhome: Path, cli) -> None:
    result = cli(
        kvhome,
        "bench",
        "--full",
        "--json",
        "--sizes",
        "300",
        "--repeat",
        "1",
        "--no-tiers",
        "--kv-type",
        "q8_0",
    )
    report = result.json
    assert report["machine"]["type_v"] == "q8_0" and report["machine"]["flash_attn"] is True
    assert [entry["flash_attn"] for entry in report["layouts"]] == [True]
    assert "f16 V cache" in report["layouts_note"]


def test_e2e_bench_reads_in_words_with_an_estimate_and_a_bar(kvhome: Path, cli) -> None:
    """The default run (one size here, small): the estimate and the bar on stderr, the
    headline first on stdout, then the table with one line per column; one V layout; no
    thread timing when told (the --full JSON test above, under stress, times them)."""
    result = cli(kvhome, "bench", "--sizes", "300", "--repeat", "1", "--no-tiers", "--no-threads")
    assert not any(line.startswith("threads: ") for line in result.stdout.splitlines())
    err = result.stderr.splitlines()
    estimate = next(line for line in err if line.startswith("this will take about "))
    assert "prompts read at" in estimate
    bars = [line for line in err if line.startswith("[") and "% " in line]
    assert bars and bars[0].endswith("tokens: resume vs re-read")
    out = result.stdout.splitlines()
    assert (
        out[0].startswith("resuming a ")
        and "-token conversation from disk: first word in" in (out[0])
    )
    assert out[0].endswith("sooner")
    assert any(line.startswith("took ") and "(estimated " in line for line in out)
    assert any(line.strip().startswith("re-read ") and "read again" in line for line in out)
    assert "chunk restores in both V layouts" not in result.stdout  # --full measures both
