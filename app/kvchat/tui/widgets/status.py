"""The status bar: model, context gauge, how the session got its KV, and the last turn."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Label

from kvchat.tui.phrases import gauge, shorten

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class StatusBar(Vertical):
    """Two lines. First: model · context gauge · memory. Second: the last turn or activity."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.model_name = ""
        self.n_ctx = 0
        self.used = 0
        self._turn_text = ""
        self._frame = 0
        self._spinner: Timer | None = None

    def on_mount(self) -> None:
        self._spinner = self.set_interval(0.1, self._spin, pause=True)

    def compose(self) -> ComposeResult:
        with Horizontal(id="status-top"):
            yield Label("", id="status-model", markup=False)
            yield Label("", id="status-ctx")
            yield Label("", id="status-memory", markup=False)
        yield Label("", id="status-turn", markup=False)

    def set_model(self, name: str, n_ctx: int) -> None:
        self.model_name, self.n_ctx = name, n_ctx
        self.query_one("#status-model", Label).update(shorten(name, 28))
        self._show_ctx()

    def set_context(self, used: int) -> None:
        self.used = used
        self._show_ctx()

    def _show_ctx(self) -> None:
        label = self.query_one("#status-ctx", Label)
        if not self.n_ctx:
            label.update("")
            return
        label.update(f"ctx {gauge(self.used, self.n_ctx)} {self.used:,}/{self.n_ctx:,}")
        ratio = self.used / self.n_ctx
        label.set_class(ratio >= 0.9, "-full")
        label.set_class(0.7 <= ratio < 0.9, "-high")

    def set_memory(self, text: str, kind: str = "") -> None:
        """How the open session's KV got into the context (restore figures)."""
        label = self.query_one("#status-memory", Label)
        label.update(text, layout=False)  # one line of a fixed width: no layout pass
        for name in ("hot", "ram", "disk", "none"):
            label.set_class(kind == name, f"-{name}")

    @property
    def memory_text(self) -> str:
        return str(self.query_one("#status-memory", Label).content)

    def set_turn(self, text: str, kind: str = "") -> None:
        """The last turn's figures, or what the app is doing now (busy: with a spinner)."""
        self._turn_text = text
        label = self.query_one("#status-turn", Label)
        for name in ("busy", "error", "warning"):
            label.set_class(kind == name, f"-{name}")
        if kind == "busy" and self._spinner is not None:
            self._spinner.resume()
        elif self._spinner is not None:
            self._spinner.pause()
        self._show_turn(busy=kind == "busy")

    def _spin(self) -> None:
        self._frame = (self._frame + 1) % len(SPINNER)
        self._show_turn(busy=True)

    def _show_turn(self, busy: bool) -> None:
        text = f"{SPINNER[self._frame]} {self._turn_text}" if busy else self._turn_text
        # One line of a fixed width: no layout pass of the whole screen (it cost ~20 ms
        # at every update while a reply streams: a key typed then waited for it).
        self.query_one("#status-turn", Label).update(text, layout=False)

    @property
    def turn_text(self) -> str:
        """The text shown, without the spinner."""
        return self._turn_text
