"""Small modal dialogs: confirm, rename, edit a message, export, session settings, code-block
picker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import (
    Button,
    Input,
    Label,
    OptionList,
    RadioButton,
    RadioSet,
    Select,
    TextArea,
)
from textual.widgets.option_list import Option

from kvchat.limits import RANGE_TEXT, sampling_problem
from kvchat.tui.phrases import block_previews, shorten
from kvchat.tui.widgets.prompt import PromptInput

FORMAT_NAMES = {"md": "Markdown", "json": "JSON", "html": "HTML"}
INTEGER_SETTINGS = frozenset({"max_tokens", "seed"})


class Dialog(ModalScreen[Any]):
    """A modal box; Esc cancels (dismisses with None)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(Dialog):
    BINDINGS = [
        Binding("y", "confirm", "Yes", show=False),
        Binding("n", "cancel", "No", show=False),
    ]

    def __init__(self, question: str, detail: str = "", yes: str = "Delete") -> None:
        super().__init__(classes="dialog-screen")
        self.question, self.detail, self.yes = question, detail, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="dialog-title", markup=False)
            if self.detail:
                yield Label(self.detail, classes="dialog-detail", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextDialog(Dialog):
    """One line of text, e.g. a new session title."""

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.value, self.placeholder = title, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Input(self.value, placeholder=self.placeholder, id="text")
            yield Label("Enter saves · Esc cancels", classes="dialog-hint")

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self.dismiss(text or None)


class EditDialog(Dialog):
    """Edit a past message of yours; like the message input, Enter confirms, Ctrl+J breaks."""

    def __init__(self, text: str) -> None:
        super().__init__(classes="dialog-screen")
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Label("Edit your message", classes="dialog-title")
            yield Label(
                "The edit starts a new branch and the reply is generated again; "
                "the original conversation is kept.",
                classes="dialog-detail",
            )
            yield PromptInput(
                self.text,
                id="edit-text",
                soft_wrap=True,
                show_line_numbers=False,
                tab_behavior="focus",
            )
            yield Label("Enter regenerates · Ctrl+J new line · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        area = self.query_one("#edit-text", PromptInput)
        area.cursor_blink = bool(getattr(self.app, "cursor_blink", True))
        area.focus()
        area.move_cursor(area.document.end)

    @on(PromptInput.Submitted)
    def _submit(self, event: PromptInput.Submitted) -> None:
        event.stop()
        text = event.text.strip()
        if not text:
            self.notify("The message is empty", severity="warning")
            return
        self.dismiss(text)


@dataclass(frozen=True)
class ExportRequest:
    fmt: str
    path: Path
    replace: bool = False  # the user agreed to replace an existing file


def free_path(path: Path) -> Path:
    """``path`` if no file has that name, else the first free ``stem-2``, ``stem-3``…"""
    if not path.exists():
        return path
    n = 2
    while (candidate := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return candidate


class ExportDialog(Dialog):
    """Choose a format and a path. The default is a free name in ``default_dir`` that follows
    the format; an existing file is replaced only after asking. From the path, ↑/↓ move the
    format (Down then Enter exports the second one); on the formats, Enter picks the
    highlighted one and goes back to the path."""

    BINDINGS = [
        Binding("down", "format(1)", "Next format", show=False),
        Binding("up", "format(-1)", "Previous format", show=False),
    ]

    def __init__(self, default_dir: Path, stem: str) -> None:
        super().__init__(classes="dialog-screen")
        self.default_dir, self.stem = default_dir, stem
        self._auto = str(free_path(default_dir / f"{stem}.md"))

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Export session", classes="dialog-title")
            with RadioSet(id="format"):
                for i, fmt in enumerate(FORMAT_NAMES):
                    yield RadioButton(FORMAT_NAMES[fmt], value=i == 0, name=fmt)
            yield Label("Save to:", classes="dialog-detail")
            # Not select-all on focus: a typed key edits the path instead of replacing it.
            yield Input(self._auto, id="path", select_on_focus=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Export", variant="primary", id="export")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        path_input = self.query_one("#path", Input)
        path_input.focus()
        path_input.cursor_position = len(path_input.value)

    @property
    def fmt(self) -> str:
        pressed = self.query_one(RadioSet).pressed_button
        return pressed.name if pressed is not None and pressed.name else "md"

    def action_format(self, step: int) -> None:
        """↑/↓ from the path: the previous / next format, pressed (so Enter exports it)."""
        buttons = list(self.query(RadioButton))
        at = next((i for i, b in enumerate(buttons) if b.value), 0)
        buttons[(at + step) % len(buttons)].value = True

    @on(RadioSet.Changed)
    def _radio_changed(self, event: RadioSet.Changed) -> None:
        if self.focused is event.radio_set:  # picked on the formats: back to the path
            self.query_one("#path", Input).focus()

    @on(RadioSet.Changed)
    def _format_changed(self) -> None:
        path_input = self.query_one("#path", Input)
        if path_input.value == self._auto:  # not edited: the default name for this format
            self._auto = str(free_path(self.default_dir / f"{self.stem}.{self.fmt}"))
            path_input.value = self._auto
            return
        path = Path(path_input.value)
        if path.suffix.lstrip(".") in FORMAT_NAMES:
            path_input.value = str(path.with_suffix("." + self.fmt))

    @on(Input.Submitted)
    @on(Button.Pressed, "#export")
    def _export(self) -> None:
        value = self.query_one("#path", Input).value.strip()
        if not value:
            self.notify("Choose a file to write", severity="warning")
            return
        path = Path(value).expanduser()
        if path.is_dir():
            self.notify(f"{path} is a folder: add a file name", severity="warning", markup=False)
            return
        if not path.exists():
            self.dismiss(ExportRequest(self.fmt, path))
            return

        def answered(replace: bool | None) -> None:
            if replace:
                self.dismiss(ExportRequest(self.fmt, path, replace=True))
            else:
                self.query_one("#path", Input).focus()

        self.app.push_screen(
            ConfirmDialog(
                f"Replace {shorten(path.name, 40)}?",
                f"{path} exists. Replace it with this export?",
                yes="Replace",
            ),
            answered,
        )

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


@dataclass(frozen=True)
class SessionSettings:
    system_prompt: str
    settings: dict[str, Any]
    tags: str = ""  # as typed ("#work rust"); checked by the dialog's ``check_tags``


def reread_note(before: str, after: str, history_tokens: int) -> str:
    """The warning shown while the system prompt differs from the saved one: the KV of the
    session begins with the system prompt, so everything after it is read again."""
    if before.strip() == after.strip() or history_tokens <= 0:
        return ""
    return (
        f"Saving a new system prompt makes the next reply re-read the whole conversation "
        f"(about {history_tokens:,} tokens): its saved memory (KV) begins with the old prompt."
    )


class SettingsDialog(Dialog):
    """The session's system prompt (typed, or from a preset) and sampling overrides; an
    empty field means the default. Values outside kvchat.limits' ranges are refused."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", show=False)]

    def __init__(
        self,
        system_prompt: str,
        values: dict[str, Any],
        defaults: dict[str, Any],
        *,
        n_ctx: int | None = None,
        presets: dict[str, str] | None = None,
        config_path: str = "the config file",
        history_tokens: int = 0,
        tags: str = "",
        check_tags: Callable[[str], str | None] | None = None,
    ) -> None:
        """``defaults``: the app-wide value of every setting a session may override;
        ``n_ctx``: the context length (bounds max_tokens); ``presets``: name → prompt;
        ``config_path``: where presets are added; ``history_tokens``: the session's size in
        tokens (what a new system prompt makes the next reply read again); ``tags``: the
        session's tags as shown (``#work #rust``); ``check_tags``: why typed tags are not
        tags (None: they are)."""
        super().__init__(classes="dialog-screen")
        self.tags = tags
        self.check_tags = check_tags
        self.system_prompt, self.values, self.defaults = system_prompt, values, defaults
        self.keys = tuple(defaults)
        self.n_ctx = n_ctx
        self.presets = presets or {}
        self.config_path = config_path
        self.history_tokens = history_tokens

    def compose(self) -> ComposeResult:
        # The fields scroll; the title, the hint and the buttons stay on screen (at 80×24
        # the buttons fell off the bottom of a dialog that scrolled as a whole).
        with Vertical(classes="dialog -wide", id="settings-dialog"):
            yield Label("Session settings", classes="dialog-title")
            with VerticalScroll(id="settings-fields"):
                yield from self._fields()
            yield Label("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Label("Ctrl+S saves · Esc cancels", classes="dialog-hint")
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def _fields(self) -> ComposeResult:
        if self.presets:
            current = next(
                (n for n, p in self.presets.items() if p == self.system_prompt.strip()),
                Select.NULL,
            )
            yield Select(
                [(name, name) for name in self.presets],
                prompt="Preset: pick a system prompt",
                value=current,
                id="preset",
                compact=True,
            )
        yield Label(
            "System prompt (empty: the app default; add presets under [presets] in "
            f"{self.config_path})",
            classes="dialog-detail",
            markup=False,
        )
        yield TextArea(self.system_prompt, id="system-prompt", soft_wrap=True)
        yield Label(self._reread_note(), id="prompt-cost", markup=False)
        yield Label(
            "Tags (#work #ideas: the sessions list's filter, Shift+F2, finds them)",
            classes="dialog-detail",
        )
        yield Input(self.tags, placeholder="#tag #another", id="tags", compact=True)
        with Grid(id="sampling"):
            for key in self.keys:
                value = self.values.get(key)
                default = self.defaults.get(key)
                shown = "random" if default is None else default
                yield Label(key.replace("_", " "))
                yield Input(
                    "" if value is None else str(value),
                    placeholder=f"default {shown} · {RANGE_TEXT.get(key, '')}",
                    id=f"set-{key}",
                    type="integer" if key in INTEGER_SETTINGS else "number",
                    compact=True,
                )

    # Rows of the dialog that are not its fields: border, padding, title, the error line
    # (when shown) and the buttons' row, each with its margin.
    FRAME_ROWS = 10

    def on_mount(self) -> None:
        self.query_one("#system-prompt", TextArea).focus()
        self._fit_fields()

    def on_resize(self) -> None:
        self._fit_fields()

    def _fit_fields(self) -> None:
        """The fields take what the screen leaves the dialog (95% of it) once its title and
        buttons are counted: they scroll, the buttons never leave the screen."""
        room = max(3, int(self.app.size.height * 0.95) - self.FRAME_ROWS)
        self.query_one("#settings-fields").styles.max_height = room

    def _reread_note(self) -> str:
        """What a changed system prompt costs, said before it is saved; "" when unchanged."""
        return reread_note(self.system_prompt, self._typed_prompt(), self.history_tokens)

    def _typed_prompt(self) -> str:
        areas = self.query("#system-prompt").results(TextArea)
        area = next(iter(areas), None)
        return area.text if area is not None else self.system_prompt

    @on(TextArea.Changed, "#system-prompt")
    def _prompt_changed(self) -> None:
        note = self._reread_note()
        label = self.query_one("#prompt-cost", Label)
        label.update(note)
        label.set_class(bool(note), "-shown")

    @on(Select.Changed, "#preset")
    def _preset_picked(self, event: Select.Changed) -> None:
        if isinstance(event.value, str) and event.value in self.presets:
            self.query_one("#system-prompt", TextArea).text = self.presets[event.value]

    def _refuse(self, key: str, problem: str) -> None:
        error = self.query_one("#settings-error", Label)
        error.update(problem)
        error.add_class("-shown")
        self.notify(problem, severity="error", markup=False)
        self.query_one(f"#set-{key}" if key != "tags" else "#tags", Input).focus()

    def action_save(self) -> None:
        values: dict[str, Any] = {}
        for key in self.keys:
            raw = self.query_one(f"#set-{key}", Input).value.strip()
            if not raw:
                continue
            try:
                value: float | int = int(raw) if key in INTEGER_SETTINGS else float(raw)
            except ValueError:
                self._refuse(key, f"{key} must be a number ({RANGE_TEXT.get(key, '')})")
                return
            problem = sampling_problem(key, value, self.n_ctx)
            if problem:
                self._refuse(key, problem)
                return
            values[key] = value
        tags = self.query_one("#tags", Input).value.strip()
        problem = self.check_tags(tags) if self.check_tags is not None else None
        if problem:
            self._refuse("tags", problem)
            return
        prompt = self.query_one("#system-prompt", TextArea).text.strip()
        self.dismiss(SessionSettings(prompt, values, tags))

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class CodePickerDialog(Dialog):
    """Pick one of several code blocks to copy: numbered as they appear on screen (the last,
    newest, highlighted), each previewed by a line that tells it from the others."""

    def __init__(self, blocks: list[str], where: list[str] | None = None) -> None:
        """``where``: for each block, the message it is in (e.g. "#4"), shown with it."""
        super().__init__(classes="dialog-screen")
        self.blocks = blocks
        self.where = where or [""] * len(blocks)

    def compose(self) -> ComposeResult:
        previews = block_previews(self.blocks)
        with Vertical(classes="dialog -wide"):
            yield Label("Copy which code block?", classes="dialog-title")
            picker = OptionList(
                *(
                    Option(
                        Content(f"{i + 1}. {f'{where} · ' if where else ''}{preview}"),
                        id=str(i),
                    )
                    for i, (preview, where) in enumerate(zip(previews, self.where))
                ),
                id="blocks",
            )
            picker.highlighted = len(self.blocks) - 1
            yield picker

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.blocks[int(event.option.id or 0)])
