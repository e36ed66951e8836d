"""The one exception type whose message is meant for the user."""

from __future__ import annotations

import sys
from typing import Any

import click


class KvchatError(Exception):
    """A problem the user can fix (bad flag, unknown session, missing model).

    The CLI prints it on one line and exits 2; the TUI shows it in a notification.
    """


class KvchatGroup(click.Group):
    """A command group that turns :class:`KvchatError` into one line on stderr, exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvchatError as exc:
            click.echo(f"kvchat: {exc}", err=True)
            sys.exit(2)
