"""The ``kvchat`` command (click is imported here and nowhere else)."""

from kvchat.cli.commands import main

__all__ = ["main"]
