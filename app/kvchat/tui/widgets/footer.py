"""The main screen's footer: Textual's, rebuilt only when the keys it shows change.

Textual's Footer recomposes all its keys (~10 widgets, their styles and a layout pass)
after every frame in which the focused widget's bindings changed, so every focus move paid
for it: a session switch (the list, then the input), Tab, a click. kvchat's widgets hide
their own keys from the footer, so what it shows rarely changes. The check runs where the
rebuild would (after the frame): comparing before it, on each bindings change, made a
session switch's frame ~5 ms later (36 vs 30 ms, median of 18 in interleaved runs).
"""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer

Shown = tuple[object, ...]


class KeysFooter(Footer):
    """A Footer that skips a rebuild when the keys it would show are the ones it shows."""

    def __init__(self, *, compact: bool = False) -> None:
        super().__init__(compact=compact)
        self._shown: Shown | None = None

    async def recompose(self) -> None:
        shown = (self.show_command_palette, *shown_keys(self.screen))
        if shown == self._shown:
            return
        self._shown = shown
        await super().recompose()


def shown_keys(screen: Screen[object]) -> Shown:
    """The keys a footer shows for ``screen``: key, action, description, enabled."""
    return tuple(
        (binding.key, binding.action, binding.description, enabled)
        for _node, binding, enabled, _tooltip in screen.active_bindings.values()
        if binding.show
    )
