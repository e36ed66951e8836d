"""Small pure helpers that turn service data into short strings for the UI."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kvchat.text import visible
from kvchat.units import human_bytes

if TYPE_CHECKING:
    from kvchat.service.chat import RestoreResult, SnapshotWrite, TurnReport

KV_LABELS = {"hot": "hot", "ram": "RAM", "disk": "disk", "none": "none"}
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)


def ago(stamp: str, now: datetime | None = None) -> str:
    """ "now", "5m ago", "3h ago", "yesterday", "4d ago" or the date (short: a sidebar line)."""
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp[:10]
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    seconds = ((now or datetime.now(UTC)) - then).total_seconds()
    if seconds < 60:
        return "now"
    if seconds < 3600:
        return f"{int(seconds // 60)}m ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h ago"
    if seconds < 2 * 86400:
        return "yesterday"
    if seconds < 7 * 86400:
        return f"{int(seconds // 86400)}d ago"
    return then.date().isoformat()


def gauge(used: int, total: int, width: int = 10) -> str:
    """A text bar such as "▰▰▰▱▱▱▱▱▱▱"."""
    if total <= 0:
        return "▱" * width
    filled = min(width, round(width * used / total))
    if used and not filled:
        filled = 1
    return "▰" * filled + "▱" * (width - filled)


def restore_phrase(result: RestoreResult) -> str:
    """How the open session got its KV, e.g. "restored 3,812 tokens from disk in 41 ms"."""
    if result.source in ("ram", "disk", "server"):
        tier = KV_LABELS.get(result.source, result.source)  # "server": a llama-server's file
        shared = " · shared prefix" if result.donor else ""
        return f"restored {result.tokens:,} tokens from {tier} in {result.ms:,.0f} ms{shared}"
    if result.source == "hot":
        return f"already hot ({result.tokens:,} tokens in the context)"
    return f"no saved KV: {result.reason}" if result.reason else "no saved KV yet"


def saved_phrase(report: TurnReport) -> str:
    """What the turn wrote to disk, e.g. "wrote 1.0 MiB to disk in 9 ms".

    What was written (only new chunks), not the snapshot's size: a long session's
    snapshot is large while a turn adds little to it.
    """
    return snapshot_phrase(report.snapshot)


def snapshot_phrase(snap: SnapshotWrite) -> str:
    """What a snapshot write put on disk (see :func:`saved_phrase`)."""
    if snap.error:
        return "not saved to disk (see the notice)"
    if snap.written:
        return f"wrote {human_bytes(snap.written)} to disk in {snap.ms:,.0f} ms"
    if snap.bytes:
        return "saved: nothing new to write to disk"
    # Written after the reply while no other work waits (kvchat.tui.main.idle_work): quick
    # turns one after another put it off, so say when it comes.
    return "saves when you pause"


FINISH_PHRASES = {
    "stop": "the model finished",
    "length": "stopped at the token limit",
    "cancelled": "stopped (Esc)",
    "context": "stopped: the context was full",
}


def local_time(stamp: str) -> str:
    """A stored UTC time as local time, e.g. "2025-06-01 14:03:05"."""
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    return then.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def turn_lines(report: TurnReport) -> list[str]:
    """The figures of the turn that produced a reply, one per line."""
    tokens = report.tokens
    speed = f" at {report.tokens_per_s:,.1f} tok/s" if report.tokens_per_s else ""
    lines = [f"Generated: {tokens.shown('generated')} tokens{speed}"]
    if report.ttft_ms is not None:
        lines.append(f"First token after: {report.ttft_ms:,.0f} ms")
    lines.append(
        f"Prompt: {tokens.shown('prompt')} tokens ({tokens.shown('reused')} reused, "
        f"{tokens.shown('decoded')} decoded)"
    )
    if tokens.rerendered:
        lines.append(
            f"Re-rendered: {tokens.rerendered:,} tokens of this reply (the template writes it "
            "differently for the next turn; re-read while idle)"
        )
    lines.append(f"KV: {restore_phrase(report.restore)}")
    lines.append(f"Saved: {saved_phrase(report)}")
    lines.append(f"Ended: {FINISH_PHRASES.get(report.finish_reason, report.finish_reason)}")
    return lines


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks in ``markdown``, in order."""
    return [m.group("body").rstrip("\n") for m in _FENCE.finditer(markdown)]


def block_previews(blocks: list[str], limit: int = 60) -> list[str]:
    """One line per code block that tells it from the others: its first line, and when
    another block starts the same way, the first of its lines no such block has."""
    lines = [[line.strip() for line in b.splitlines() if line.strip()] for b in blocks]
    previews = []
    for i, own in enumerate(lines):
        first = own[0] if own else ""
        alike = [other for j, other in enumerate(lines) if j != i and other[:1] == own[:1]]
        shown = first
        if alike:
            seen = {line for other in alike for line in other}
            distinct = next((line for line in own[1:] if line not in seen), None)
            if distinct is not None:
                shown = f"{first} … {distinct}"
        count = len(blocks[i].splitlines())
        previews.append(f"{shorten(shown, limit)} ({count:,} line{'s' if count != 1 else ''})")
    return previews


def shorten(text: str, limit: int) -> str:
    """One visible line of at most ``limit`` characters, e.g. a title in a notice."""
    text = " ".join(visible(text).split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def slug(title: str) -> str:
    """A file-name-safe version of a session title."""
    s = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return s[:40] or "session"
