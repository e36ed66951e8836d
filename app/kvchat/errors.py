"""The one exception type whose message is meant for the user."""

from __future__ import annotations


class KvchatError(Exception):
    """A problem the user can fix (bad flag, unknown session, missing model).

    The CLI prints it on one line and exits 2; the TUI shows it in a notification.
    """
