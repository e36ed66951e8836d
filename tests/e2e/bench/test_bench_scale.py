"""`kvchat bench --ui --sessions`'s machinery at CI size: homes of 100 and 1,000
imported conversations, and the growth between them of the app's first paint (the newest
session drawn) and of that process's memory; the long session's switches, search jump and
typing while a reply streams, at CI size. The full run (10,000 sessions, the running app, a
5,000-message session) is the stress test at the end."""

from __future__ import annotations

import pytest

from kvchat.bench.export_gen import LONG_TITLE, RARE_WORD, rare_hits
from kvchat.bench.paint import first_paint
from kvchat.bench.scale import (
    NEWEST_TITLE,
    add_long_session,
    build_home,
    format_long,
    measure_list,
    measure_long,
    measure_search,
)
from kvchat.config import Settings
from tests.conftest import run_cli_here


def test_first_paint_and_its_memory_grow_less_than_half_from_100_to_1000_sessions(tmp_path):
    figures = {}
    for n in (100, 1000):
        home = tmp_path / f"home-{n}"
        built = build_home(home, n, 2, tmp_path)
        assert built.imported == 2 * n
        listed = run_cli_here(home, "list", "--json", "--limit", "1").json
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
    hits = run_cli_here(home, "list", "--json").json
    assert len(hits) == 300
    measure_list(home, built, 1)
    assert built.list_ms > 0 and built.list_all_ms > 0
    assert RARE_WORD not in NEWEST_TITLE


@pytest.mark.stress  # its full size is tests/stress/test_bench_at_full_size.py
def test_long_session_switches_jumps_and_streams_as_the_scale_bench_times_it(tmp_path):
    """The long-session part of the scale bench at CI size: a few sessions and one of 300
    one-word messages, in a 768-token context (the oldest messages leave the window, as a
    5,000-message session's do, and the prompt read stays short). What the machine's load
    does not move: the switches happened each way, the jump landed on message #1, every
    key was timed while the reply streamed."""
    home = tmp_path / "home"
    build_home(home, 4, 2, tmp_path)
    long = add_long_session(home, 300, tmp_path, sizes=(1, 1))
    assert long.messages == 300
    listed = run_cli_here(home, "list", "--json").json
    assert listed[0]["title"].startswith(NEWEST_TITLE)  # the long one second, reachable
    assert listed[1]["title"].startswith(LONG_TITLE) and listed[1]["messages"] == 300
    measure_long(home, long, keys=20, rounds=1, n_ctx=768)
    print("\n" + "\n".join(format_long(long)))
    assert long.error is None, long.error
    assert len(long.to_long) == len(long.from_long) == 1
    for switch in long.switches:
        assert switch.drawn_ms > 0 and switch.ready_ms >= switch.drawn_ms > 0
    assert long.jump_landed and long.jump_number == 1 and long.jump_ms > 0
    assert 0 < long.jump_mounted < 150  # the window around the hit, not the whole session
    assert len(long.echo_ms) == 20 and min(long.echo_ms) > 0
    assert long.echo_streamed > 0  # the reply went on streaming while the keys were timed
    data = long.to_json()
    assert set(data["bounds"]) == {"switch_over_restore_ms", "jump_ms", "echo_p95_ms"}
    assert all(b["measured"] is not None for b in data["bounds"].values())
    assert data["bounds"]["switch_over_restore_ms"]["bound"] == 50.0
    assert data["bounds"]["jump_ms"]["bound"] == 200.0
    assert data["bounds"]["echo_p95_ms"]["bound"] == 50.0
