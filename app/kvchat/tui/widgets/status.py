"""The status bar: model, context gauge, how the session got its KV, and the last turn."""

from __future__ import annotations

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Label

from kvchat.tui.phrases import gauge, shorten

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
# Below this many columns the context gauge drops its bar and the model's name is cut
# shorter: the memory part (the KV badge) keeps its room.
COMPACT_COLUMNS = 100


def fit_parts(text: str, cells: int) -> str:
    """``text`` ("a · b · c · d") in ``cells``: its first part (what happened) and its last
    (a hint: "F12 continues it") are kept, the parts before the last dropped from the end
    until it fits, then an ellipsis if even that is too long."""
    if cells <= 0 or cell_len(text) <= cells:
        return text
    parts = text.split(" · ")
    while len(parts) > 2 and cell_len(" · ".join(parts)) > cells:
        del parts[-2]
    fitted = " · ".join(parts)
    if cell_len(fitted) <= cells:
        return fitted
    return shorten(fitted, cells)


class StatusBar(Vertical):
    """Two lines. First: model · context gauge · memory. Second: the last turn or activity."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.model_name = ""
        self.n_ctx = 0
        self.used = 0
        self.reserve = 0  # kept free for the reply (0: not known yet)
        self.warn = False  # the next turn would leave messages out of the window
        self._turn_text = ""
        self._busy = False
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

    def on_resize(self) -> None:
        if self.model_name:
            self.query_one("#status-model", Label).update(shorten(self.model_name, self._name_room))
        self._show_ctx()
        self._show_turn(self._busy)

    @property
    def _compact(self) -> bool:
        return 0 < self.app.size.width < COMPACT_COLUMNS

    @property
    def _name_room(self) -> int:
        return 20 if self._compact else 28

    def set_model(self, name: str, n_ctx: int) -> None:
        self.model_name, self.n_ctx = name, n_ctx
        self.query_one("#status-model", Label).update(shorten(name, self._name_room))
        self._show_ctx()

    def set_context(self, used: int) -> None:
        self.used = used
        self._show_ctx()

    def set_window(self, reserve: int, warn: bool) -> None:
        """The gauge's part from the window (a turn's, or an opened session's): the tokens
        kept for the reply, and whether the next turn would leave messages out (the gauge
        then shows full). What the context holds stays :meth:`set_context`'s."""
        self.reserve, self.warn = reserve, warn
        self._show_ctx()

    def _show_ctx(self) -> None:
        label = self.query_one("#status-ctx", Label)
        if not self.n_ctx:
            label.update("")
            return
        bar = "" if self._compact else f"{gauge(self.used, self.n_ctx)} "
        reserve = f" +{self.reserve:,} reply" if self.reserve and not self._compact else ""
        mark = " !" if self.warn else ""
        label.update(f"ctx {bar}{self.used:,}/{self.n_ctx:,}{reserve}{mark}")
        ratio = (self.used + self.reserve) / self.n_ctx
        label.set_class(ratio >= 0.9 or self.warn, "-full")
        label.set_class(0.7 <= ratio < 0.9 and not self.warn, "-high")

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
        self._busy = kind == "busy"
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
        label = self.query_one("#status-turn", Label)
        text = f"{SPINNER[self._frame]} {self._turn_text}" if busy else self._turn_text
        width, lines = label.content_size.width, max(1, label.content_size.height)
        # Wrapped lines break between words: leave each line a word's slack.
        text = fit_parts(text, width * lines - (lines - 1) * 12)
        # One line of a fixed width: no layout pass of the whole screen (it cost ~20 ms
        # at every update while a reply streams: a key typed then waited for it).
        label.update(text, layout=False)

    @property
    def turn_text(self) -> str:
        """The text shown, without the spinner."""
        return self._turn_text
