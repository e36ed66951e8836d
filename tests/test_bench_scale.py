"""`kvchat bench --ui --sessions`'s machinery at CI size (issue 26): homes of 100 and 1,000
imported conversations, and the growth between them of the app's first paint (the newest
session drawn) and of that process's memory. The full run (10,000 sessions, the running app)
is the stress test at the end."""

from __future__ import annotations

import json

import pytest

from kvchat.bench.export_gen import RARE_WORD, rare_hits
from kvchat.bench.paint import first_paint
from kvchat.bench.scale import NEWEST_TITLE, build_home, measure_list, measure_search
from kvchat.config import Settings
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e  # app and import processes


def test_first_paint_and_its_memory_grow_less_than_half_from_100_to_1000_sessions(tmp_path):
    figures = {}
    for n in (100, 1000):
        home = tmp_path / f"home-{n}"
        built = build_home(home, n, 2, tmp_path)
        assert built.imported == 2 * n
        listed = run_cli(home, "list", "--json", "--limit", "1").json
        assert listed[0]["title"].startswith(NEWEST_TITLE) and listed[0]["messages"] == 2
        figures[n] = first_paint(home, 3, shows=NEWEST_TITLE)
    paint = figures[1000]["total_ms"] / figures[100]["total_ms"]
    memory = figures[1000]["rss_mb"] / figures[100]["rss_mb"]
    print(f"\nfirst paint ×{paint:.2f}, its RSS ×{memory:.2f} from 100 to 1,000 sessions")
    assert paint < 1.5, figures
    assert memory < 1.5, figures


def test_search_and_list_figures_count_what_they_read(tmp_path):
    home = tmp_path / "home"
    built = build_home(home, 300, 10, tmp_path)
    assert built.imported == 3000 and built.import_peak_rss_mb > 0
    measure_search(Settings(), home, built, 1)
    assert built.search_hits == {"rare": rare_hits(300, 10), "common": 50}  # 50: one page
    assert rare_hits(300, 10) == 3
    hits = run_cli(home, "list", "--json").json
    assert len(hits) == 300
    measure_list(home, built, 1)
    assert built.list_ms > 0 and built.list_all_ms > 0
    assert RARE_WORD not in NEWEST_TITLE


def check_full_run(report: dict) -> None:
    """The issue's bounds that a shared machine's load does not move: counts, ratios to
    the one-conversation baseline, memory growth, idle CPU."""
    homes = {h["sessions"]: h for h in report["homes"]}
    assert sorted(homes) == [1, 100, 1000, 10000]
    for n, home in homes.items():
        assert home["imported"] == 50 * n
        assert home["search_hits"]["rare"] == min(50, rare_hits(n, 50))
        assert home["echo_keys"] == 30
    big = homes[10000]
    assert big["against_baseline"]["first_paint_x"] < 1.5
    assert big["against_baseline"]["rss_growth_mb"] < 100
    assert big["idle_cpu"] < 0.01
    # Peak memory of the import does not grow with the file (4 MB -> 413 MB of JSON).
    assert big["import_peak_rss_mb"] < 1.2 * homes[100]["import_peak_rss_mb"]


@pytest.mark.stress
def test_stress_ten_thousand_conversations(tmp_path):
    """The issue's full run: 100, 1,000 and 10,000 sessions × 50 messages, the running app
    included (the figures are printed: `pytest -m stress -s`)."""
    result = run_cli(
        tmp_path / "unused",
        "bench",
        "--ui",
        "--sessions",
        "100,1000,10000",
        "--messages",
        "50",
        "--repeat",
        "3",
        "--json",
    )
    report = json.loads(result.stdout)
    print("\n" + json.dumps(report, indent=2))
    check_full_run(report)
