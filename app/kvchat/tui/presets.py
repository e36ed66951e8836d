"""System prompt presets for the settings dialog: a few built in, more from the config file.

Users add their own in the config file's ``[presets]`` table, one ``name = "prompt"`` per
line; a user preset with a built-in's name replaces it. The settings themselves ignore
that table, so it is read here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

BUILT_IN: dict[str, str] = {
    "Concise": "Answer briefly and directly. Skip preambles and repetition.",
    "Programmer": (
        "You are an experienced programmer. Answer with correct, complete code in fenced "
        "blocks and a short explanation; say which language and version you assume."
    ),
    "Teacher": (
        "Explain step by step in plain words, with one small example, and check the "
        "reader's understanding with a question at the end."
    ),
    "Translator": (
        "Translate the user's text into English. Reply with the translation only, keeping "
        "the formatting."
    ),
}


def load_presets(path: Path | None = None) -> tuple[dict[str, str], str | None]:
    """The presets by name (built-ins first) and a problem with the file to show, if any."""
    from kvchat.paths import config_file

    path = path or config_file()
    presets = dict(BUILT_IN)
    if not path.is_file():
        return presets, None
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh).get("presets", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return presets, f"presets not read from {path}: {exc}"
    if not isinstance(table, dict):
        return presets, f'[presets] in {path} must be a table of name = "prompt"'
    skipped = []
    for name, prompt in table.items():
        if isinstance(prompt, str) and prompt.strip():
            presets[str(name)] = prompt.strip()
        else:
            skipped.append(str(name))
    if skipped:
        return presets, f"presets in {path} that are not text were skipped: {', '.join(skipped)}"
    return presets, None
