"""Saving what the user chose in the app (the theme, the default model) to the config file.

Only the keys given are written, each as a top-level ``key = value`` line: an existing line
of that key is replaced in place (its trailing comment kept), a new key goes above the
first ``[table]`` (top-level keys must come before tables in TOML). Every other line, the
user's comments and layout included, stays as it was. The new file is written beside the
old one, synced and renamed over it (0600), so a crash leaves the old file or the new,
never half of one. A file that is not valid TOML is not touched: one clear line says so.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import config_file, ensure_private_dir
from kvchat.system import current as current_system

# Keys this module may write: what the app lets the user pick (kvchat.config's fields).
WRITABLE = frozenset({"theme", "model", "open_with_session_model"})
# Values longer than this are not a theme or model name (a path is at most a few hundred).
MAX_VALUE_CHARS = 4096
# A config file larger than this is not one kvchat edits (nor one a person wrote).
MAX_FILE_BYTES = 1 << 20

_TABLE = re.compile(r"^\s*\[")
_KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_-]+)\s*=")

Value = str | bool


def save_config_values(values: Mapping[str, Value], path: Path | None = None) -> Path:
    """Write ``values`` (keys of :data:`WRITABLE`) into the config file, keeping the rest
    of it as it is; returns the file written. KvchatError (one line) when it cannot."""
    path = config_file() if path is None else path
    for key, value in values.items():
        if key not in WRITABLE:
            raise KvchatError(f"kvchat does not write {key!r} to the config file")
        if isinstance(value, str) and (len(value) > MAX_VALUE_CHARS or "\x00" in value):
            raise KvchatError(f"the value of {key} is not one kvchat writes")
    old = _read(path)
    text = with_values(old, values)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # never expected: said rather than written
        raise KvchatError(f"config file {path} would not be valid TOML: {exc}") from None
    write_config_text(path, text)
    return path


def with_values(text: str, values: Mapping[str, Value]) -> str:
    """``text`` (a TOML file's contents) with each top-level key of ``values`` set."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    first_table = next((i for i, line in enumerate(lines) if _TABLE.match(line)), len(lines))
    new: list[str] = []
    for key, value in values.items():
        rendered = f"{key} = {_toml_value(value)}"
        at = next(
            (
                i
                for i in range(first_table)
                if (match := _KEY_LINE.match(lines[i])) and match["key"] == key
            ),
            None,
        )
        if at is None:
            new.append(rendered + "\n")
            continue
        comment = _trailing_comment(lines[at])
        lines[at] = rendered + (f"  {comment}" if comment else "") + "\n"
    if new:
        # Above the first table, after the top-level lines (and a blank line before a table).
        insert_at = first_table
        while insert_at > 0 and not lines[insert_at - 1].strip():
            insert_at -= 1
        tail = ["\n"] if insert_at < len(lines) else []
        lines[insert_at:insert_at] = new + tail if insert_at == first_table else new
    return "".join(lines)


def _toml_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False)  # a TOML basic string is a JSON string


def _trailing_comment(line: str) -> str | None:
    """The ``# comment`` after a ``key = value`` line's value (None: there is none). Only
    what follows a value TOML can hold without a ``#`` inside it is looked at: a string
    value is skipped as a whole."""
    body = line.split("=", 1)[1]
    in_string: str | None = None
    escaped = False
    for i, char in enumerate(body):
        if in_string is not None:
            if escaped:
                escaped = False
            elif char == "\\" and in_string == '"':
                escaped = True
            elif char == in_string:
                in_string = None
        elif char in "\"'":
            in_string = char
        elif char == "#":
            return body[i:].rstrip("\n").rstrip()
    return None


def _read(path: Path) -> str:
    """The config file's text ("" when there is none); a file that is not TOML is refused."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise KvchatError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise KvchatError(f"config file {path} is larger than {MAX_FILE_BYTES} bytes: not edited")
    try:
        text = raw.decode("utf-8")
        tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KvchatError(
            f"config file {path} is not valid TOML ({exc}): fix it, then choose again"
        ) from None
    return text


def write_config_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, sync it, rename it over ``path``."""
    try:
        if not path.parent.is_dir():
            ensure_private_dir(path.parent)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = current_system().open_no_follow(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise KvchatError(f"cannot write config file {path}: {exc.strerror or exc}") from None


__all__ = ["WRITABLE", "save_config_values", "with_values", "write_config_text"]
