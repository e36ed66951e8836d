"""Screens under a stack of dialogs keep being drawn (issue 41, item 3).

A translucent dialog draws the screen under it as its background. When that screen changes,
Textual repaints the top screen only. With one dialog that is enough: the top draws the
changed screen afresh. With two (a dialog and the command palette over it, or a dialog over
a dialog), the top draws the dialog between as it last drew itself, and that picture still
holds the screen under it as it was: a reply streaming under a dialog with the palette open
stopped on screen until a resize (a full redraw) or until the palette closed.

:class:`RepaintsScreensAbove` makes a screen that changed while covered repaint every
translucent screen between it and the top too, over the regions that changed, so each one
draws it afresh.
"""

from __future__ import annotations

from textual.screen import Screen


class RepaintsScreensAbove(Screen[None]):
    """A screen whose changes reach the terminal through every dialog stacked over it."""

    def _compositor_refresh(self) -> None:
        # Textual's hook for a screen's changed regions (pinned Textual: see the test extra);
        # tests/unit/tui/test_frames_keep_coming_under_dialogs.py checks what reaches the
        # terminal through a stack of two.
        regions = list(self._compositor._dirty_regions)
        super()._compositor_refresh()
        if not regions or self.app.screen is self:
            return
        stack = self.app.screen_stack
        if self not in stack:
            return
        between = stack[stack.index(self) + 1 : -1]
        for screen in between:
            if screen in self.app._background_screens:
                screen.refresh(*regions)
