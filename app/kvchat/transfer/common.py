"""What every import format hands back (:class:`ImportedSession`), the limits that bound a
file before it is read, and the checks that turn a bad file into one line naming it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvchat.errors import KvchatError
from kvchat.limits import sampling_problem
from kvchat.service.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningStyle, split_reasoning
from kvchat.service.reports import SESSION_SETTINGS, SESSION_SWITCHES, tool_switch_problem

# A JSON file (or a bundle's messages.json) larger than this is refused before it is read.
MAX_JSON_BYTES = 256 << 20
# Messages and sessions one file may hold (a ChatGPT export of years of use stays far below).
MAX_MESSAGES = 1_000_000
MAX_SESSIONS = 100_000
# One message's text, where a format can hold more than its file's size suggests (SQLite).
MAX_TEXT_CHARS = 64 << 20
TITLE_CHARS = 48
# How deeply arrays and objects may nest in any JSON an import reads (every format kvchat
# reads needs fewer than 10 levels; Python's parser would recurse for each level).
MAX_JSON_DEPTH = 100

# A JSON string (escapes included), to blank out before brackets are counted.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if chr(c) not in "[]{}")


class ImportedTool(NamedTuple):
    """What a tool message (role ``tool``) is about: the tool, the call, the whole result."""

    name: str
    call_id: str
    arguments: str = "{}"  # a JSON object
    is_error: bool = False
    truncated: bool = False
    full_text: str | None = None  # None: the message's content is the whole result


# The calls a reply made: (call id, tool name, arguments as a JSON object).
ImportedCall = tuple[str, str, str]


class ImportedMessage(NamedTuple):
    """One message as kvchat stores it: user, assistant or tool (a system prompt is the
    session's)."""

    role: str
    content: str
    partial: bool = False
    created: str | None = None  # ISO 8601, UTC, as the store writes it; None: the session's
    token_count: int = 0
    reasoning: str = ""  # a thinking model's reasoning before the answer
    tool: ImportedTool | None = None  # a tool message's tool and call
    calls: tuple[ImportedCall, ...] = ()  # a reply's tool calls


# A tool's name, a call's id and its arguments as an import keeps them, at most.
TOOL_NAME_CHARS = 200
CALL_ID_CHARS = 200
ARGUMENTS_CHARS = 1 << 20


def imported_call(
    path: Path, name: object, call_id: object, arguments: object, where: str
) -> ImportedCall:
    """A tool call read from a file: its id (``""`` when none), the tool's name and the
    arguments (a JSON object, or a string holding one), each bounded; else one line."""
    if not isinstance(name, str) or not name.strip() or len(name) > TOOL_NAME_CHARS:
        raise BadFile(
            path, f"{where} has no tool name (a string of 1-{TOOL_NAME_CHARS} characters)"
        )
    name = check_text(path, " ".join(name.split()), f"{where}.name") or ""
    if call_id is None:
        call_id = ""
    if not isinstance(call_id, str) or len(call_id) > CALL_ID_CHARS:
        raise BadFile(
            path, f"{where}'s call id is not a string of at most {CALL_ID_CHARS} characters"
        )
    call_id = check_text(path, call_id, f"{where}.id") or ""
    if isinstance(arguments, str):
        if len(arguments) > ARGUMENTS_CHARS:
            raise BadFile(path, f"{where}'s arguments are over {ARGUMENTS_CHARS:,} characters")
        arguments = parse_json(path, arguments, f"{where}'s arguments") if arguments.strip() else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadFile(path, f"{where}'s arguments are not a JSON object")
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise BadFile(path, f"{where}'s arguments are not plain JSON") from None
    if len(text) > ARGUMENTS_CHARS:
        raise BadFile(path, f"{where}'s arguments are over {ARGUMENTS_CHARS:,} characters")
    return call_id, name, check_text(path, text, f"{where}.arguments") or "{}"


class ImportedSummary(NamedTuple):
    """A compaction summary of an imported session, checked
    (:mod:`kvchat.transfer.imported_summaries`): ``message`` indexes the session's imported
    messages (the last one it stands for)."""

    message: int
    text: str
    replaced_tokens: int


class ImportedDocument(NamedTuple):
    """One document of an imported session, checked
    (:mod:`kvchat.transfer.imported_documents`); ``message`` indexes the session's imported
    messages (None: given at the start)."""

    name: str
    kind: str
    size: int
    sha256: str
    text: str
    pages: int | None
    message: int | None


def reply_parts(
    path: Path, role: str, content: str, reasoning: object, where: str
) -> tuple[str, str]:
    """(answer, reasoning) of an imported message: the file's own reasoning text when it
    has one (``reasoning_content``), else a reply's leading ``<think>…</think>`` block."""
    if role != "assistant":
        return content, ""
    if isinstance(reasoning, str):
        text = check_text(path, reasoning, f"{where}.reasoning_content") or ""
        return content, text.strip()
    if content.lstrip().startswith(THINK_OPEN) and THINK_CLOSE in content:
        thought, answer = split_reasoning(content, ReasoningStyle("think"))
        return answer, thought
    return content, ""


@dataclass
class ImportedSession:
    """One conversation read from a file, before it is stored: every reader returns these."""

    title: str
    system_prompt: str | None
    settings: dict[str, Any]
    messages: list[ImportedMessage]
    # Where it came from in its source ("chatgpt:<conversation id>"...), None when the
    # source has no ids; with it, a re-exported archive does not import it twice.
    source_key: str | None = None
    created: str | None = None
    updated: str | None = None
    # Messages the format holds that kvchat has no place for (tool calls and results,
    # images, hidden context), left out.
    skipped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Its documents (kvchat's own exports and bundles carry them).
    documents: list[ImportedDocument] = field(default_factory=list)
    # Its compaction summaries, oldest first (kvchat's own exports and bundles carry them).
    summaries: list[ImportedSummary] = field(default_factory=list)


class BadFile(KvchatError):
    """A file that cannot be imported; the message names the file and says why, on one line."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason
        self.path = str(path)
        self.reason = reason


def title_from(text: str, limit: int = TITLE_CHARS) -> str:
    """A session title from a message: its first words on one line."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def default_title(messages: list[ImportedMessage], fallback: str = "Imported chat") -> str:
    first = next((m.content for m in messages if m.role == "user" and m.content.strip()), "")
    return title_from(first) or fallback


def decode_utf8(path: Path, data: bytes) -> str:
    """The file's text (a leading BOM dropped); invalid UTF-8 is refused with its offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadFile(path, f"not UTF-8 text (invalid byte at offset {exc.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (strings skipped), counted at C speed
    before any parser recurses into it."""
    bare = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass")
    brackets = np.frombuffer(bare.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps, dtype=np.int64).max())


def parse_json(path: Path, text: str, what: str = "JSON") -> Any:
    """Parse JSON text from a file, bounded in depth; every failure is one line naming it."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise BadFile(
            path, f"{what} nests {depth:,} levels deep (at most {MAX_JSON_DEPTH}): refused"
        )
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BadFile(
            path, f"not valid {what} (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except ValueError as exc:  # NaN / Infinity
        raise BadFile(path, f"not valid {what} ({exc})") from None
    except RecursionError:
        raise BadFile(path, f"{what} nested too deeply") from None


def load_json(path: Path, data: bytes, what: str = "JSON") -> Any:
    """Parse a JSON document, mapping every failure to one line that names the file."""
    if len(data) > MAX_JSON_BYTES:
        raise BadFile(
            path, f"{what} of {len(data):,} bytes is over the {MAX_JSON_BYTES:,}-byte limit"
        )
    return parse_json(path, decode_utf8(path, data), what)


def check_text(path: Path, value: object, where: str, *, optional: bool = False) -> str | None:
    """A string field, checked to be storable text (no lone surrogates from \\ud800 escapes)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        kind = "missing" if value is None else f"a {type(value).__name__}, not text"
        raise BadFile(path, f"{where} is {kind}")
    if len(value) > MAX_TEXT_CHARS:
        raise BadFile(path, f"{where} is over {MAX_TEXT_CHARS:,} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadFile(path, f"{where} holds invalid Unicode (a lone surrogate escape)") from None
    return value


def require(path: Path, document: object, key: str, kind: type, where: str) -> Any:
    """``document[key]``, which must exist and be a ``kind``."""
    if not isinstance(document, dict) or key not in document:
        raise BadFile(path, f"{where} has no {key!r} field")
    value = document[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = {dict: "an object", list: "a list", str: "text", int: "an integer"}
        raise BadFile(path, f"{where}.{key} is not {names.get(kind, kind.__name__)}")
    return value


def iso_time(value: object) -> str | None:
    """A timestamp (ISO 8601 text or epoch seconds) as the store writes it, else None.

    The store sorts sessions by these strings, so every one is normalised to UTC with
    milliseconds; anything unreadable is None (the import's own time is used instead).
    """
    moment: datetime | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if math.isfinite(value) and 0 <= value < 1e11:
            moment = datetime.fromtimestamp(float(value), UTC)
    elif isinstance(value, str) and 10 <= len(value) <= 40:
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    if moment is None or not 1970 <= moment.year <= 9999:
        return None
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")


def _number(integer: bool = False, high: float = math.inf) -> Callable[[object], bool]:
    """A type check: a finite number (a whole one with ``integer``) up to ``high``."""

    def ok(value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if integer and not isinstance(value, int):
            return False
        return math.isfinite(value) and value <= high

    return ok


# The type of each setting; its range is kvchat.limits', the same as the CLI's and the app's.
_SETTING_TYPES: dict[str, Callable[[object], bool]] = {
    "temperature": _number(),
    "top_p": _number(),
    "max_tokens": _number(integer=True, high=1 << 20),
    "seed": lambda v: v is None or _number(integer=True, high=2**63 - 1)(v),
    "think": lambda v: v is None or isinstance(v, bool),
    "tools_off": lambda v: tool_switch_problem("tools_off", v) is None,
    "tools_always": lambda v: tool_switch_problem("tools_always", v) is None,
}
assert set(_SETTING_TYPES) == set(SESSION_SETTINGS) | set(SESSION_SWITCHES)


def check_settings(path: Path, settings: object, where: str) -> dict[str, Any]:
    """A session's sampling overrides: known names with values in the ranges every other
    way in allows (:func:`kvchat.limits.sampling_problem`)."""
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise BadFile(path, f"{where} is not an object")
    for name, value in settings.items():
        check = _SETTING_TYPES.get(name)
        if check is None:
            raise BadFile(path, f"{where} has an unknown setting {name!r}")
        if not check(value):
            raise BadFile(path, f"{where}.{name} has an invalid value {value!r:.80}")
        problem = None if value is None else sampling_problem(name, value)
        if problem is not None:
            raise BadFile(path, f"{where}.{name} has an invalid value: {problem}")
    return dict(settings)


def count_messages(path: Path, sessions: list[ImportedSession]) -> None:
    """Refuse a file over the session or message limits."""
    if len(sessions) > MAX_SESSIONS:
        raise BadFile(path, f"{len(sessions):,} conversations is over the {MAX_SESSIONS:,} limit")
    total = sum(len(s.messages) for s in sessions)
    if total > MAX_MESSAGES:
        raise BadFile(path, f"{total:,} messages is over the {MAX_MESSAGES:,} limit")
