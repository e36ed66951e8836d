"""Chat templates: the model's own, a built-in one by name, or a Jinja file.

A GGUF usually carries its chat template (``tokenizer.chat_template``); that one is used.
Some carry none (Gemma 3 270M's). Then the ``chat_template`` setting decides (a built-in
name of :data:`BUILTIN` or the path of a Jinja file), else the catalog's choice for that
model file, else ChatML, with a note saying that it is a guess and how to pick one. A
``chat_template`` setting also replaces a template the GGUF has (a broken one).

A template change never reuses KV wrongly: snapshots are keyed on token ids, so a prompt
rendered by another template shares only the ids it really shares.

Pure Python: no model library is imported here (the engines, the planner and ``kvchat config``
use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma 2 and 3: no system role (the system prompt opens the first user turn), the
# assistant is "model", and every turn ends with <end_of_turn>.
GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if loop.first %}{{ first_prefix }}{% endif %}{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Mistral instruct ([INST] … [/INST]); a system prompt opens the first user message.
MISTRAL = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}[INST] {% if loop.first %}{{ system }}{% endif %}"
    "{{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

PHI3 = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

BUILTIN: dict[str, str] = {
    "chatml": CHATML,
    "gemma": GEMMA,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "phi3": PHI3,
}
# The largest Jinja file read as a template.
MAX_TEMPLATE_BYTES = 256 * 1024


@dataclass(frozen=True)
class ChosenTemplate:
    """The template a model is rendered with, and why."""

    text: str
    name: str  # "gguf", a built-in name, or the file's path
    source: str  # "gguf", "setting", "catalog" or "fallback"
    note: str | None = None  # shown to the user (status line, ask's stderr, kvchat config)


def builtin_names() -> str:
    return ", ".join(BUILTIN)


def load_template(value: str) -> tuple[str, str]:
    """(text, name) of a ``chat_template`` setting: a built-in name or a Jinja file."""
    key = value.strip()
    if key.lower() in BUILTIN:
        return BUILTIN[key.lower()], key.lower()
    path = Path(key).expanduser()
    if not path.is_file():
        raise KvchatError(
            f"unknown chat template {value!r}: use a built-in name ({builtin_names()}) "
            "or the path of a Jinja template file"
        )
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise KvchatError(f"chat template file {path} is larger than 256 KiB")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvchatError(f"cannot read chat template {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise KvchatError(f"chat template file {path} is not UTF-8 text") from None
    if not text.strip():
        raise KvchatError(f"chat template file {path} is empty")
    return text, str(path)


def choose_template(
    setting: str | None, gguf_template: str | None, catalog_template: str | None = None
) -> ChosenTemplate:
    """The template for a model: the setting, else the GGUF's own, else the catalog's
    choice for the file, else ChatML (with a note: a guess)."""
    has_own = bool(gguf_template and gguf_template.strip())
    if setting and setting.strip():
        text, name = load_template(setting)
        if has_own:
            note = f"chat template: {name} (your chat_template setting, not the model's own)"
        else:
            note = f"chat template: {name} (your chat_template setting; the GGUF has none)"
        return ChosenTemplate(text, name, "setting", note)
    if has_own:
        assert gguf_template is not None
        return ChosenTemplate(gguf_template, "gguf", "gguf")
    if catalog_template and catalog_template.strip().lower() in BUILTIN:
        name = catalog_template.strip().lower()
        return ChosenTemplate(
            BUILTIN[name],
            name,
            "catalog",
            f"the GGUF has no chat template: using {name} (the catalog's choice for this "
            "model); set chat_template to change it",
        )
    return ChosenTemplate(
        CHATML,
        "chatml",
        "fallback",
        "the GGUF has no chat template: using ChatML, a guess that may not suit this model; "
        f"pick one with --chat-template NAME|FILE (built in: {builtin_names()})",
    )


def catalog_template(model_path: Path) -> str | None:
    """The catalog's chat template for a model file (matched by file name), if any."""
    try:
        from kvchat.planner.gguf_info import find_entry, load_catalog

        entry = find_entry(model_path.name, load_catalog())
    except KvchatError:
        return None
    return (entry.chat_template or None) if entry is not None else None
