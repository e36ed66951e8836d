"""``kvchat bench --docs --json`` at a small context: per document length (and the largest
that fits), the first conversation reads the document, a later one restores that reading
and reads only its question, with a greedy reply equal to the same conversation read with
nothing kept. Counts and flags are asserted, never speed."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.stress  # the read-once proofs are e2e/attachments/test_read_once*.py
def test_e2e_bench_docs_reads_a_document_once(kvhome: Path, cli) -> None:
    result = cli(kvhome, "bench", "--docs", "--json", "--sizes", "200,5000", "--n-ctx", "700")
    report = result.json
    # 5,000 does not fit the context; the largest that does (n_ctx less room to ask: the
    # context llama.cpp made, 700 rounded up) is measured instead.
    n_ctx = report["machine"]["n_ctx"]
    assert 700 <= n_ctx < 1024
    assert [row["target"] for row in report["rows"]] == [200, n_ctx - 400]
    assert len(report["skipped"]) == 1 and report["skipped"][0].startswith("5,000 tokens")
    for row in report["rows"]:
        assert row["document_tokens"] >= row["target"] * 0.9
        # The first read the document; the later one only its question and the markup.
        assert row["first_decoded"] > row["document_tokens"]
        assert 0 < row["later_decoded"] < 40
        # Exactly: the re-read decodes the whole prompt, the later one all but the reading.
        assert row["reread_decoded"] - row["later_decoded"] == row["document_tokens"]
        assert row["restored_from"] in ("disk", "ram")
        assert row["greedy_equal"] is True
        assert row["sooner"] > 0 and row["later_ms"] > 0
    assert report["headline"][0].startswith(
        f"a {report['rows'][-1]['document_tokens']:,}-token document"
    )
