"""Commands typed in the input: ``/NAME ARGUMENTS`` where NAME is a command kvchat knows.

Text is text: only a message whose first word is a registered command runs it; anything
else that starts with a slash (``/etc/hosts is empty?``, ``/shrug``) is sent as typed, and
``//NAME …`` sends ``/NAME …`` as a message. ``/help`` lists the commands. The collaborator
that owns a command registers it (its name, a one-line summary, a usage line and a handler
taking the text after the name); the screen asks :meth:`SlashCommands.dispatch` before it
sends a message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# A command's name: a lowercase word (letters, digits, dashes), 1-24 characters.
_NAME = re.compile(r"[a-z][a-z0-9-]{0,23}")
# The first word of a message that may name a command: "/name" then a space, a newline or
# the end.
_FIRST_WORD = re.compile(r"/([a-z][a-z0-9-]{0,23})(?=\s|$)")

SlashHandler = Callable[[str], None]


@dataclass(frozen=True)
class SlashCommand:
    """One command: ``handler`` gets the text after the name, stripped ('' when none)."""

    name: str
    summary: str
    usage: str
    handler: SlashHandler


@dataclass(frozen=True)
class Dispatched:
    """What :meth:`SlashCommands.dispatch` did with a message: ``ran`` (a command took it),
    or ``text`` to send as a message (the typed text, or one slash less after ``//``)."""

    ran: bool
    text: str


class SlashCommands:
    """The commands of one screen, by name."""

    def __init__(self) -> None:
        self._commands: dict[str, SlashCommand] = {}
        self.register("help", "List the commands typed in the input", "/help", self._no_help_shown)
        self._show_help: Callable[[str], None] | None = None

    def register(self, name: str, summary: str, usage: str, handler: SlashHandler) -> None:
        """Adds a command; a name already taken (or not a lowercase word) is a bug."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a command name: {name!r}")
        if name in self._commands and name != "help":
            raise ValueError(f"command /{name} is registered twice")
        self._commands[name] = SlashCommand(name, summary, usage, handler)

    def on_help(self, show: Callable[[str], None]) -> None:
        """Where ``/help`` shows its list (a notification, a dialog)."""
        self._show_help = show

    def commands(self) -> list[SlashCommand]:
        """Every command, by name."""
        return [self._commands[name] for name in sorted(self._commands)]

    def help_text(self) -> str:
        """One line a command, then how to send a message that starts with a slash."""
        lines = [f"{command.usage} — {command.summary}" for command in self.commands()]
        lines.append("//… sends a message that starts with a slash")
        return "\n".join(lines)

    def dispatch(self, typed: str) -> Dispatched:
        """Runs the command ``typed`` names, or says what to send instead."""
        text = typed.strip()
        if text.startswith("//"):
            return Dispatched(False, typed.replace("//", "/", 1))
        found = _FIRST_WORD.match(text)
        command = self._commands.get(found.group(1)) if found else None
        if found is None or command is None:
            return Dispatched(False, typed)
        if command.name == "help":
            if self._show_help is not None:
                self._show_help(self.help_text())
        else:
            command.handler(text[found.end() :].strip())
        return Dispatched(True, "")

    def _no_help_shown(self, _arguments: str) -> None:
        """``/help``'s placeholder handler (dispatch shows the list itself)."""
