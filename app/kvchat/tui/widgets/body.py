"""A message's Markdown, built as it is composed.

Textual's Markdown widget parses its text after it is mounted, in a worker thread, and
mounts its blocks after that: a session opened with a few dozen messages costs a thread
hop and a second layout per message, and a frame can show a message as an empty box in
between. A stored message's text is known and short, so this one parses it at once and
composes its blocks with it. A body composed empty (a reply about to stream) stays a
plain Markdown widget. Imported on first use (see ``conversation.py``).
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.widgets import Markdown


class MessageBody(Markdown):
    """Markdown whose blocks are composed with it (see the module docstring)."""

    _built = False

    def compose(self) -> ComposeResult:
        source = self._initial_markdown
        if not source:
            return
        parser = self._parser_factory() if self._parser_factory is not None else None
        if parser is None:
            return  # Textual's default parser: leave it to Markdown's own mount
        self._initial_markdown = None
        self._markdown = source
        self._theme = self.app.theme
        lines = source.splitlines()
        self._last_parsed_line = len(lines) - (1 if lines and lines[-1] else 0)
        self._built = True
        yield from self._parse_markdown(parser.parse(source))

    async def _on_mount(self, event: events.Mount) -> None:
        if self._built:
            event.prevent_default()  # Markdown's own mount would parse it all again
