"""``kvchat bench --docs``: read once, ask forever, measured. Per document length N, three
conversations start with the same N-token document (``kvchat ask -a``'s machinery): the
first reads it; a later one restores that reading and reads only its question; the same
later one with ``--no-restore`` reads everything again, for the baseline and the check that
its greedy reply equals the restored one's.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.bench.progress import BenchPlan, Reporter, Step, prefill_seconds
from kvchat.bench.report import column_notes, machine, machine_line, seconds_words, times_words
from kvchat.bench.runs import _paragraph
from kvchat.config import Settings
from kvchat.service.chat import ChatService, open_service
from kvchat.service.documents import DocumentShelf

FIRST_QUESTION = "What is this document about? Answer in one sentence."
LATER_QUESTION = "Name three words that appear in this document."
# Tokens kept free beside the largest document: the questions, the template, the reply.
ROOM = 400
REPLY_TOKENS = 16


@dataclass
class DocRow:
    target: int
    document_tokens: int
    first_ms: float  # the first conversation: the document read, then the first token
    first_decoded: int
    later_ms: float  # a later conversation: the reading restored, its question read
    later_decoded: int
    reread_ms: float  # the later conversation with --no-restore
    reread_decoded: int
    sooner: float  # reread_ms ÷ later_ms
    greedy_equal: bool
    restored_from: str

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class DocsReport:
    rows: list[DocRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    estimate_s: float = 0.0
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "headline": docs_headline(self),
            "rows": [r.to_json() for r in self.rows],
            "skipped": self.skipped,
            "estimate_s": round(self.estimate_s, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "machine": self.machine,
        }


def write_document(path: Path, service: ChatService, target: int) -> None:
    """A plain-text document of about ``target`` tokens."""
    engine = service.load_engine()
    rng = random.Random(target)
    parts: list[str] = []
    count = 0
    while count < target:
        paragraph = _paragraph(rng, 120)
        parts.append(paragraph)
        count += engine.count_tokens(paragraph) + 2
    path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")


def sizes_that_fit(targets: list[int], n_ctx: int) -> tuple[list[int], list[str]]:
    """The targets that leave room for a conversation, plus the largest that does; and a
    line for each that does not."""
    largest = n_ctx - ROOM
    fitting = sorted({t for t in targets if t <= largest} | {largest})
    skipped = [
        f"{t:,} tokens: does not fit n_ctx={n_ctx:,} with room to ask (largest: {largest:,})"
        for t in targets
        if t > largest
    ]
    return fitting, skipped


def run_docs(
    settings: Settings, targets: list[int], *, reporter: Reporter | None = None
) -> DocsReport:
    out = reporter or Reporter()
    report = DocsReport()
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-docs-") as scratch_name,
        open_service(settings, home=Path(scratch_name) / "home") as service,
    ):
        scratch = Path(scratch_name)
        engine = service.load_engine()
        report.machine = machine(engine)
        out.say(machine_line(report.machine))
        fitting, report.skipped = sizes_that_fit(targets, engine.n_ctx)
        for line in report.skipped:
            out.say(f"skipping {line}")
        config = engine.config
        speeds = engine.measure_threads([config.n_threads], prompt=128, generate=8)
        rate = float(speeds.get(str(config.n_threads), {}).get("prefill") or 0) or 300.0
        plan = BenchPlan(
            tuple(
                Step(f"doc-{t}", f"a {t:,}-token document", 2 * prefill_seconds(t, rate) + 4)
                for t in fitting
            )
        )
        report.estimate_s = plan.seconds + time.monotonic() - started
        out.begin(plan, rate)
        for target in fitting:
            out.step(f"doc-{target}")
            report.rows.append(_one_size(service, scratch, target, out))
    out.finish()
    report.elapsed_s = time.monotonic() - started
    report.machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _one_size(service: ChatService, scratch: Path, target: int, out: Reporter) -> DocRow:
    path = scratch / f"document-{target}.txt"
    write_document(path, service, target)
    params = {"max_tokens": REPLY_TOKENS, "temperature": 0.0}
    out.say(f"{target:,}: the first conversation reads the document…")
    first = service.start(FIRST_QUESTION, documents=DocumentShelf.read([str(path)]), **params)
    out.say(f"{target:,}: a later conversation restores the reading…")
    later = service.start(LATER_QUESTION, documents=DocumentShelf.read([str(path)]), **params)
    out.say(f"{target:,}: the same with --no-restore, for the baseline…")
    reread = service.start(
        LATER_QUESTION, documents=DocumentShelf.read([str(path)]), no_restore=True, **params
    )
    # What the later conversation restored: the system prompt and the document's block.
    document_tokens = later.tokens.reused
    later_ms, reread_ms = later.ttft_ms or 0.0, reread.ttft_ms or 0.0
    return DocRow(
        target=target,
        document_tokens=document_tokens,
        first_ms=first.ttft_ms or 0.0,
        first_decoded=first.tokens.decoded,
        later_ms=later_ms,
        later_decoded=later.tokens.decoded,
        reread_ms=reread_ms,
        reread_decoded=reread.tokens.decoded,
        sooner=reread_ms / later_ms if later_ms else 0.0,
        greedy_equal=later.reply == reread.reply,
        restored_from=later.restore.source,
    )


DOC_COLUMNS: tuple[tuple[str, str], ...] = (
    (
        "document",
        "the tokens read once: the system prompt and the document as the model reads them",
    ),
    ("first", "the first conversation about it: the document read, to the first word"),
    (
        "later",
        "a later conversation with the same document: its reading restored, only the "
        "question read, to the first word",
    ),
    ("re-read", "that later conversation with nothing kept (--no-restore)"),
    ("sooner", "re-read ÷ later"),
    ("decoded", "tokens read by first / later / re-read (llama.cpp's count)"),
    ("greedy", "later's greedy reply equals re-read's"),
)


def docs_headline(report: DocsReport) -> list[str]:
    if not report.rows:
        return []
    r = max(report.rows, key=lambda row: row.document_tokens)
    return [
        f"a {r.document_tokens:,}-token document: the first conversation's first word in "
        f"{seconds_words(r.first_ms)}, every later one's in {seconds_words(r.later_ms)} "
        f"— {times_words(r.sooner)} sooner than reading it again ({seconds_words(r.reread_ms)})"
    ]


def format_docs(report: DocsReport) -> str:
    lines = [*docs_headline(report), "", machine_line(report.machine)]
    lines.append(f"took {report.elapsed_s:.0f} s (estimated {report.estimate_s:.0f} s)")
    header = (
        f"{'document':>9} {'first':>8} {'later':>8} {'re-read':>8} {'sooner':>7} "
        f"{'decoded':>22} {'greedy':>7}"
    )
    lines += ["", header, "-" * len(header)]
    for r in report.rows:
        decoded = f"{r.first_decoded:,} / {r.later_decoded:,} / {r.reread_decoded:,}"
        lines.append(
            f"{r.document_tokens:>9,} {seconds_words(r.first_ms):>8} "
            f"{seconds_words(r.later_ms):>8} {seconds_words(r.reread_ms):>8} "
            f"{times_words(r.sooner):>7} {decoded:>22} {'yes' if r.greedy_equal else 'NO':>7}"
        )
    lines += column_notes(DOC_COLUMNS)
    lines += [f"  skipped {line}" for line in report.skipped]
    return "\n".join(lines)
