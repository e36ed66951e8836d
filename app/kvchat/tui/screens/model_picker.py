"""The model picker: the catalog's models and the local GGUF files, each with its fit.

Enter on a model that is here loads it (the screen dismisses with that choice); Ctrl+D makes
the highlighted one the default model (the screen's owner saves it); a catalog
model that is not downloaded is listed, greyed, with the command that fetches it (nothing
downloads from the app). Esc cancels. Names and paths are shown as plain text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from kvchat.tui.phrases import shorten

if TYPE_CHECKING:
    from kvchat.service.model_choices import ModelChoice

HINT = (
    "Enter loads the model · Ctrl+D makes it the default · Esc cancels · "
    "get another: kvchat models pull NAME"
)


def choice_content(choice: ModelChoice) -> Content:
    """ "● name · size · source · thinking · hybrid" over the fit (or how to download it),
    all plain text."""
    mark = "● " if choice.loaded else "  "
    where = "loaded" if choice.loaded else choice.source
    kinds = "".join(f" · {kind}" for kind in choice.marks)
    head = Content.styled(mark + shorten(choice.name, 48), "bold") + Content(
        f" · {choice.size} · {where}{kinds}"
    )
    detail = choice.pull_hint or choice.fit
    return Content("\n").join([head, Content("    " + detail)])


class ModelScreen(ModalScreen["ModelChoice | None"]):
    """The choices as a list; ``selected`` (a model file) starts highlighted."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", show=False),
        Binding("ctrl+d", "make_default", "Make this the default model", show=False),
    ]
    DEFAULT_CSS = """
    ModelScreen #model-list {
        height: 1fr;
    }
    ModelScreen #model-list > .option-list--option {
        padding: 0 1;
    }
    """

    def __init__(
        self,
        choices: list[ModelChoice],
        selected: Path | None = None,
        note: str | None = None,
        *,
        on_default: Callable[[ModelChoice], None] | None = None,
    ) -> None:
        super().__init__(classes="dialog-screen")
        self.choices = choices
        self.selected = selected
        self.note = note
        # Ctrl+D: the highlighted model becomes the default (its owner saves it).
        self.on_default = on_default

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall", id="models"):
            yield Label("Pick a model", classes="dialog-title")
            if self.note:
                yield Label(self.note, id="models-note", classes="dialog-detail", markup=False)
            yield OptionList(
                *(
                    Option(choice_content(c), id=str(i), disabled=not c.present)
                    for i, c in enumerate(self.choices)
                ),
                id="model-list",
            )
            yield Label(HINT, classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        options = self.query_one("#model-list", OptionList)
        options.focus()
        start = self._start_index()
        if start is not None:
            options.highlighted = start

    def _start_index(self) -> int | None:
        """The pre-selected model, else the loaded one, else the first that is here."""
        indexes = range(len(self.choices))
        if self.selected is not None:
            for i in indexes:
                path = self.choices[i].path
                if path is not None and _same(path, self.selected):
                    return i
        loaded = next((i for i in indexes if self.choices[i].loaded), None)
        if loaded is not None:
            return loaded
        return next((i for i in indexes if self.choices[i].present), None)

    @property
    def highlighted_choice(self) -> ModelChoice | None:
        index = self.query_one("#model-list", OptionList).highlighted
        return self.choices[index] if index is not None else None

    @on(OptionList.OptionSelected, "#model-list")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        choice = self.choices[int(event.option.id or 0)]
        if choice.present:
            self.dismiss(choice)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_make_default(self) -> None:
        """Ctrl+D: the highlighted model (one that is here) is the one kvchat starts with."""
        choice = self.highlighted_choice
        if choice is None or not choice.present:
            self.notify("Pick a model that is here to make it the default", severity="warning")
            return
        if self.on_default is not None:
            self.on_default(choice)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
