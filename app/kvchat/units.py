"""Formatting of sizes for people, shared by the CLI and the terminal app."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``1536`` → ``"1.5 KiB"``; binary units, as the budgets in the config are."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{n} B"
