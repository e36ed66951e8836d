"""``kvchat bench --peers``' report (model-free): the headline names every measured row's
first word and how kvchat compares with the best peer, a row that could not run says why
in its place, every column is explained, the plan counts the server's reads only when it
runs, and the JSON reads back into the same tables."""

from __future__ import annotations

from kvchat.bench.peers import (
    DISK_CACHE,
    HOW,
    KVCHAT_DISK,
    KVCHAT_RAM,
    PEER_COLUMNS,
    PEERS,
    RE_READ,
    SERVER,
    PeerRow,
    PeersReport,
    format_peers,
    peers_headline,
    plan_peers,
)

MIB = 2**20


def _row(peer: str, ttft: dict[str, float], **extra: object) -> PeerRow:
    row = PeerRow(peer, HOW[peer], ttft_ms=ttft, **extra)  # type: ignore[arg-type]
    return row


def _report() -> PeersReport:
    reread = {"1187": 8600.0, "4185": 47000.0}
    rows = [
        _row(RE_READ, reread, greedy_equal=True, written_per_turn=0.0, shared_disk_bytes=0),
        _row(
            DISK_CACHE,
            {"1187": 900.0, "4185": 2100.0},
            greedy_equal=False,
            greedy_note="differs at 4185 tokens;",
            written_per_turn=140 * MIB,
            written_over_new_kv=40.0,
        ),
        _row(
            SERVER, {}, missing="not measured: no llama-server is built here (kvchat server build)"
        ),
        _row(
            KVCHAT_DISK,
            {"1187": 240.0, "4185": 380.0},
            greedy_equal=True,
            written_per_turn=3.5 * MIB,
        ),
        _row(KVCHAT_RAM, {"1187": 230.0, "4185": 370.0}, greedy_equal=True),
    ]
    for row in rows:
        for size, ms in row.ttft_ms.items():
            row.sooner[size] = reread[size] / ms
    report = PeersReport(rows=rows, sizes=[1187, 4185], turns=20, conversations=10)
    report.prefix_tokens = 2132
    report.machine = {}
    return report


def test_the_headline_names_each_rows_first_word_and_the_best_peer() -> None:
    report = _report()
    kv = report.row(KVCHAT_DISK)
    kv.own_reread_ms["4185"] = 46000.0
    kv.sooner_than_own["4185"] = 46000.0 / 380.0
    lines = peers_headline(report)
    assert lines[0] == (
        "resuming a 4,185-token conversation after a restart, first word: re-read 47 s, "
        "LlamaDiskCache 2.1 s, kvchat (disk) 0.38 s, kvchat (RAM) 0.37 s"
    )
    assert lines[1] == (
        "kvchat from disk: first word in 0.38 s instead of 46 s reading it again (121× "
        "sooner); 5.5× sooner than LlamaDiskCache (2.1 s)"
    )
    assert lines[2] == "per turn kvchat wrote 3.5 MiB, LlamaDiskCache 140 MiB"
    assert lines[3] == (
        "llama-server slots: not measured: no llama-server is built here (kvchat server build)"
    )


def test_a_peer_as_quick_as_kvchat_is_said_level_and_a_quicker_one_quicker() -> None:
    report = _report()
    report.row(DISK_CACHE).ttft_ms["4185"] = 390.0
    assert "level with LlamaDiskCache (0.39 s)" in peers_headline(report)[1]
    report.row(DISK_CACHE).ttft_ms["4185"] = 190.0
    assert "LlamaDiskCache is 2.0× sooner (0.19 s)" in peers_headline(report)[1]


def test_the_table_says_why_a_row_is_missing_and_explains_every_column() -> None:
    text = format_peers(_report())
    lines = text.splitlines()
    (server,) = [line for line in lines if line.startswith(SERVER + " ")]
    assert "kvchat server build" in server
    (disk,) = [line for line in lines if line.startswith(DISK_CACHE + " ")]
    assert "  NO " in disk  # an unequal greedy reply is said, loudly
    assert "0.90 s / 2.1 s" in disk and "9.6× / 22×" in disk
    for name, meaning in PEER_COLUMNS:
        assert any(line.strip().startswith(name) and line.endswith(meaning) for line in lines)
    for peer in PEERS:
        assert f"  {peer}: {HOW[peer]}" in lines
    assert "a snapshot made with another KV type:" in lines


def test_the_json_reads_back_into_the_same_tables() -> None:
    report = _report()
    again = PeersReport.from_json(report.to_json())
    assert format_peers(again) == format_peers(report)
    assert again.to_json()["headline"] == peers_headline(report)


def test_the_plan_counts_the_servers_reads_only_when_it_runs() -> None:
    kwargs = dict(repeat=3, turns=20, conversations=10, prefix=2000)
    with_server = plan_peers([1024, 4096], 450.0, server=True, **kwargs)  # type: ignore[arg-type]
    without = plan_peers([1024, 4096], 450.0, server=False, **kwargs)  # type: ignore[arg-type]
    assert [s.key for s in with_server.steps] == [
        "resume-1024",
        "resume-4096",
        "turns",
        "shared",
        "foreign",
    ]
    assert without.seconds < with_server.seconds
    # Minutes, not hours, at this machine's prompt speed.
    assert 60 < with_server.seconds < 600
