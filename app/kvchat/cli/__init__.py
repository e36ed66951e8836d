"""The ``kvchat`` command (click is imported here and nowhere else)."""

from kvchat.cli.commands import main
from kvchat.cli.server_commands import server

main.add_command(server)

__all__ = ["main"]
