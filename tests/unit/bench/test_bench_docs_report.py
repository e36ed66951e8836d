"""``kvchat bench --docs``' sizes and words (model-free)."""

from __future__ import annotations

from kvchat.bench.docs import DOC_COLUMNS, DocRow, DocsReport, format_docs, sizes_that_fit


def test_sizes_that_fit_add_the_largest_and_say_what_does_not() -> None:
    fitting, skipped = sizes_that_fit([2048, 8192], 8192)
    assert fitting == [2048, 7792]
    assert skipped == ["8,192 tokens: does not fit n_ctx=8,192 with room to ask (largest: 7,792)"]
    assert sizes_that_fit([2048, 8192], 32768) == ([2048, 8192, 32368], [])


def test_the_docs_report_says_it_in_words_and_explains_its_columns() -> None:
    row = DocRow(2048, 2210, 9100.0, 2240, 120.0, 17, 9300.0, 2232, 77.5, True, "disk")
    report = DocsReport(rows=[row], machine={})
    text = format_docs(report)
    assert text.splitlines()[0] == (
        "a 2,210-token document: the first conversation's first word in 9.1 s, every later "
        "one's in 0.12 s — 78× sooner than reading it again (9.3 s)"
    )
    assert "2,240 / 17 / 2,232" in text
    for name, meaning in DOC_COLUMNS:
        assert any(
            line.strip().startswith(name) and line.endswith(meaning) for line in text.splitlines()
        )
    assert report.to_json()["rows"][0]["greedy_equal"] is True
