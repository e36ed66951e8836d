"""The one exception type whose message is meant for the user."""

from __future__ import annotations


class KvchatError(Exception):
    """A problem the user can fix (bad flag, unknown session, missing model).

    The CLI prints it on one line and exits 2; the TUI shows it in a notification.
    """


class DocumentError(KvchatError):
    """A file or folder named as an attachment that kvchat will not read: the message is one
    line that names the file and says what is wrong (and the limit, where one was passed)."""
