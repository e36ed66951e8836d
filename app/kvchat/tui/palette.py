"""The command palette (Ctrl+P) lists every action of the key table."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from kvchat.tui.keys import KEYS


class KvchatCommands(Provider):
    """One entry per action, with its key as the help text."""

    def _entries(self) -> list[tuple[str, str, str]]:
        return [(k.description, k.action, k.label) for k in KEYS if k.palette and k.action]

    async def discover(self) -> Hits:
        for title, action, label in self._entries():
            yield DiscoveryHit(title, partial(self._run, action), help=f"key: {label}")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, action, label in self._entries():
            score = matcher.match(title)
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(title),
                    partial(self._run, action),
                    text=title,
                    help=f"key: {label}",
                )

    async def _run(self, action: str) -> None:
        await self.app.run_action(action, self.screen)
