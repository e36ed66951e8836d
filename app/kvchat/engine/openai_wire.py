"""The boundary with an OpenAI-compatible server: every byte it sends, read once, bounded.

Whatever the server sends — the ``/models`` list, llama-server's ``/props``, an error body,
a non-streaming completion, each server-sent event of a stream — is read here with a byte
cap and a time cap and parsed into typed, bounded values before the rest of kvchat sees
it. What does not fit is one :class:`WireError` line, never a traceback:

- **size**: a body at most :data:`MAX_BODY_BYTES`, one event at most
  :data:`MAX_EVENT_BYTES`, a whole stream at most :data:`MAX_STREAM_BYTES`;
- **depth**: JSON nested deeper than :data:`MAX_DEPTH` is refused by a scan of its
  brackets *before* ``json.loads`` could recurse;
- **numbers**: ``NaN``/``Infinity`` and floats that overflow (``1e999``) are refused
  where they are parsed; an integer of more than :data:`MAX_INT_DIGITS` digits too;
- **counts** (usage, timings, ``n_ctx``, ``total_slots``): integers 0..:data:`MAX_COUNT`
  (not floats, not strings, not booleans); a figure outside that is not shown and the
  figures say so (:attr:`Usage.doubts`); a server's hint (``n_ctx``, slots) that is not a
  count is taken as not said;
- **text**: lone surrogates become U+FFFD (SQLite and the terminal take only valid
  Unicode); what reaches a one-line message (a server's error, a finish reason, a model
  id) is made visible on one line (:func:`kvchat.text.one_line`); reply text keeps its
  characters, as the store keeps them, and is made harmless where it is shown;
- **time**: a stream ends when no event came for ``idle_s`` (keep-alive comments and
  bytes that never make an event do not count) or after ``total_s`` in all.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvchat.errors import KvchatError
from kvchat.text import one_line

# Bytes of one JSON body (a model list, props, an error, a non-streaming completion).
MAX_BODY_BYTES = 8 * 1024 * 1024
# Bytes of one server-sent event (one line of it, or its data lines together).
MAX_EVENT_BYTES = 1024 * 1024
# Bytes of a whole stream.
MAX_STREAM_BYTES = 64 * 1024 * 1024
# Events without text a stream may send (role-only deltas, progress, empty choices).
MAX_EMPTY_EVENTS = 4096
# Nesting of JSON arrays and objects (the deepest real shape is about 5).
MAX_DEPTH = 32
# A count (tokens, slots, a context size): an integer from 0 to this.
MAX_COUNT = 10**9
# Digits of an integer literal (longer ones are refused before int() reads them).
MAX_INT_DIGITS = 24
# Characters of a one-line field: a model id, a finish reason, an error message.
MAX_ID_CHARS = 256
MAX_MESSAGE_CHARS = 300
# Choices in one chunk (kvchat asks for one).
MAX_CHOICES = 16

# Seconds a stream may send no event at all (the server reads the prompt first: a long
# prompt on a slow machine takes minutes; keep-alive comments do not count).
STREAM_IDLE_S = 600.0
# Seconds a whole stream may last.
STREAM_TOTAL_S = 4 * 3600.0
# Seconds to wait for the usage chunk once the server said the reply is finished.
FINISHED_IDLE_S = 5.0
# Seconds a short request (model list, props) may take in all.
REQUEST_TOTAL_S = 60.0
# An HTTP error's body: the bytes and seconds read of it (the rest is not needed).
MAX_ERROR_BYTES = 64 * 1024
ERROR_BODY_S = 10.0


class WireError(KvchatError):
    """What the server sent is not what kvchat reads: ``what`` says how, in a few words
    ("a stream event nested deeper than 32 levels"); the caller names the server."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class WireTimeout(WireError):
    """A read ran past its time cap (``after_finish``: the reply was whole already)."""


@dataclass
class StreamLimits:
    """The caps of one stream (the engine's, replaceable for tests)."""

    idle_s: float = STREAM_IDLE_S
    total_s: float = STREAM_TOTAL_S
    finished_idle_s: float = FINISHED_IDLE_S
    max_event_bytes: int = MAX_EVENT_BYTES
    max_stream_bytes: int = MAX_STREAM_BYTES


# --- JSON, bounded ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


class _Refused(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _Refused(f"a number that is not finite ({name})")


def _float(text: str) -> float:
    if len(text) > 64:
        raise _Refused("a number literal too long")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"a number that is not finite ({text[:24]})")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """How deep the arrays and objects of JSON ``text`` nest, counted outside strings and
    without recursion; stops counting once past ``limit`` (returns limit + 1)."""
    if text.count("[") + text.count("{") <= limit:
        return 0 if "[" not in text and "{" not in text else 1
    outside = _STRING.sub('""', text)
    depth = deepest = 0
    for match in _BRACKET.finditer(outside):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                return limit + 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads(raw: bytes | str, what: str, cap: int = MAX_BODY_BYTES) -> Any:
    """``raw`` as JSON, or a :class:`WireError` naming ``what`` (e.g. "the model list"):
    at most ``cap`` bytes, :data:`MAX_DEPTH` deep, finite numbers, bounded integers."""
    if len(raw) > cap:
        raise WireError(f"{what} larger than {cap:,} bytes")
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if nesting_depth(text) > MAX_DEPTH:
        raise WireError(f"{what} nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except _Refused as exc:
        raise WireError(f"{what} with {exc}") from None
    except (ValueError, RecursionError):
        raise WireError(f"{what} that is not JSON") from None


# --- values ----------------------------------------------------------------------------------

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def clean_text(value: str) -> str:
    """``value`` with lone surrogates (JSON's ``"\\ud800"``) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value


def line_of(value: Any, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Any value as one visible line of at most ``limit`` characters."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)[: limit * 4]
        except (TypeError, ValueError, RecursionError):
            value = type(value).__name__
    text = one_line(clean_text(value[: limit * 4]))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def count(value: Any) -> int | None:
    """``value`` if it is an integer count 0..:data:`MAX_COUNT` (not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def _text_field(holder: dict[str, Any], *names: str) -> str:
    """The first of ``names`` that ``holder`` has as text ("" when none); a value of any
    other type than text or null is a :class:`WireError`."""
    for name in names:
        value = holder.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise WireError(f"a chunk whose {name} is {json_kind(value)}, not text")
        if value:
            return clean_text(value)
    return ""


def json_kind(value: Any) -> str:
    """What a JSON value is, in words (for a line saying what a field held)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "text" if isinstance(value, str) else "null"


@dataclass(frozen=True)
class Usage:
    """``usage`` as the server sent it: each figure a count, or None (not sent, or not a
    count: then ``doubts`` says which)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    doubts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timings:
    """llama-server's ``timings``: counts or None; a speed, finite and positive, or None."""

    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    predicted_per_second: float | None = None
    doubts: tuple[str, ...] = ()


def _figure(holder: dict[str, Any], name: str, where: str, doubts: list[str]) -> int | None:
    if name not in holder or holder[name] is None:
        return None
    value = count(holder[name])
    if value is None:
        doubts.append(f"{where}.{name} {line_of(holder[name], 24)} is not a count")
    return value


def parse_usage(value: Any) -> Usage | None:
    """``usage`` of a chunk or completion (None: absent or not an object)."""
    if not isinstance(value, dict):
        return None
    doubts: list[str] = []
    prompt = _figure(value, "prompt_tokens", "usage", doubts)
    completion = _figure(value, "completion_tokens", "usage", doubts)
    details = value.get("prompt_tokens_details")
    cached = None
    if isinstance(details, dict):
        cached = _figure(details, "cached_tokens", "usage.prompt_tokens_details", doubts)
    if cached is not None and prompt is not None and cached > prompt:
        doubts.append(f"usage says {cached:,} cached of {prompt:,} prompt tokens")
        cached = None
    return Usage(prompt, completion, cached, tuple(doubts))


def parse_timings(value: Any) -> Timings | None:
    """llama-server's ``timings`` (None: absent or not an object)."""
    if not isinstance(value, dict):
        return None
    doubts: list[str] = []
    cache_n = _figure(value, "cache_n", "timings", doubts)
    prompt_n = _figure(value, "prompt_n", "timings", doubts)
    predicted_n = _figure(value, "predicted_n", "timings", doubts)
    speed = value.get("predicted_per_second")
    per_second = None
    if isinstance(speed, int | float) and not isinstance(speed, bool):
        if math.isfinite(speed) and 0 < speed <= MAX_COUNT:
            per_second = float(speed)
    return Timings(cache_n, prompt_n, predicted_n, per_second, tuple(doubts))


@dataclass(frozen=True)
class Chunk:
    """What one streamed ``chat.completion.chunk`` (or a whole completion) carries."""

    reasoning: str = ""
    content: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None


def parse_chunk(event: Any) -> Chunk:
    """One event of a stream (or a non-streaming completion: its ``message`` is read as a
    delta): text from every choice, its finish reason and figures; an ``error`` event's
    message. A shape kvchat cannot read is a :class:`WireError`."""
    if not isinstance(event, dict):
        raise WireError(f"a stream event that is {json_kind(event)}, not an object")
    if "error" in event and event["error"] is not None:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return Chunk(error=line_of(message if message is not None else error) or "an error")
    choices = event.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise WireError(f"a chunk whose choices is {json_kind(choices)}, not a list")
    if len(choices) > MAX_CHOICES:
        raise WireError(f"a chunk with {len(choices):,} choices")
    reasoning = content = ""
    finish: str | None = None
    for choice in choices:
        if not isinstance(choice, dict):
            raise WireError(f"a chunk whose choice is {json_kind(choice)}, not an object")
        delta = choice.get("delta")
        if delta is None:
            delta = choice.get("message")
        if delta is None:
            delta = {}
        if not isinstance(delta, dict):
            raise WireError(f"a chunk whose delta is {json_kind(delta)}, not an object")
        reasoning += _text_field(delta, "reasoning_content", "reasoning")
        content += _text_field(delta, "content")
        reason = choice.get("finish_reason")
        if reason is not None:
            if not isinstance(reason, str):
                raise WireError(f"a chunk whose finish_reason is {json_kind(reason)}, not text")
            if reason:
                finish = line_of(reason, 40)
    return Chunk(
        reasoning,
        content,
        finish,
        parse_usage(event.get("usage")),
        parse_timings(event.get("timings")),
    )


@dataclass(frozen=True)
class ModelEntry:
    """The first model a ``/models`` list names: its id, who owns it, llama-server's
    context size (0: not said)."""

    id: str = ""
    owned_by: str = ""
    n_ctx: int = 0


def parse_models(value: Any) -> ModelEntry:
    """The first entry of a ``/models`` reply (an empty entry when it lists none)."""
    if not isinstance(value, dict):
        raise WireError(f"a model list that is {json_kind(value)}, not an object")
    entries = value.get("data")
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        return ModelEntry()
    first = entries[0]
    model_id = first.get("id")
    if model_id is None:
        model_id = ""
    if not isinstance(model_id, str):
        raise WireError(f"a model id that is {json_kind(model_id)}, not text")
    if len(model_id) > MAX_ID_CHARS or model_id != one_line(clean_text(model_id)):
        raise WireError(f"a model id that is not a short printable name ({line_of(model_id, 60)})")
    owner = first.get("owned_by")
    meta = first.get("meta")
    n_ctx = count(meta.get("n_ctx")) if isinstance(meta, dict) else None
    return ModelEntry(model_id, owner if isinstance(owner, str) else "", n_ctx or 0)


def parse_slots(value: Any) -> int:
    """llama-server's slot count from its ``/props`` (0: not said, or not a count)."""
    slots = count(value.get("total_slots")) if isinstance(value, dict) else None
    return slots or 0


def error_message(raw: bytes) -> str:
    """The message of an HTTP error body, one visible line ("" when none)."""
    try:
        detail = loads(raw, "an error body")
    except WireError:
        return line_of(raw[:MAX_MESSAGE_CHARS].decode("utf-8", "replace"))
    error = detail.get("error", detail) if isinstance(detail, dict) else detail
    message = error.get("message", "") if isinstance(error, dict) else error
    return line_of(message if message is not None else "")


# --- reads with a byte cap and a time cap ------------------------------------------------------


def _set_timeout(conn: http.client.HTTPConnection, seconds: float) -> None:
    sock = conn.sock
    if sock is not None:
        sock.settimeout(max(0.01, seconds))


def read_body(
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
    cap: int = MAX_BODY_BYTES,
    total_s: float = REQUEST_TOTAL_S,
    *,
    truncate: bool = False,
) -> bytes:
    """The whole body, at most ``cap`` bytes, within ``total_s`` seconds (a server that
    sends one byte a second is cut off): else a :class:`WireError`. ``truncate``: what
    came by then, never an error (an HTTP error's body, only for its message). Connection
    errors propagate as they are (OSError, HTTPException)."""
    deadline = time.monotonic() + total_s
    parts: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise WireTimeout(f"a reply that took longer than {total_s:,.0f} s")
            _set_timeout(conn, left)
            try:
                part = response.read1(65536)
            except TimeoutError:
                raise WireTimeout(f"a reply that took longer than {total_s:,.0f} s") from None
            if size + len(part) > cap:
                parts.append(part[: cap - size])
                raise WireError(f"a reply larger than {cap:,} bytes")
        except (WireError, OSError, http.client.HTTPException, ValueError):
            if truncate:
                return b"".join(parts)
            raise
        if not part:
            return b"".join(parts)
        size += len(part)
        parts.append(part)


class EventReader:
    """The ``data:`` payloads of a server-sent event stream, each parsed as bounded JSON
    (a ``[DONE]`` or the end of the stream ends it), with the caps of ``limits``.

    ``broken`` turns a connection error into the caller's one-line error. :meth:`finished`
    shortens the idle cap once the reply is whole (only its figures may still come).
    """

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        limits: StreamLimits,
        broken: Callable[[BaseException], KvchatError],
    ) -> None:
        self._conn = conn
        self._response = response
        self.limits = limits
        self._broken = broken
        self._idle_s = limits.idle_s
        self.bytes_read = 0

    def finished(self) -> None:
        self._idle_s = min(self._idle_s, self.limits.finished_idle_s)
        self._last = time.monotonic()

    def _chunks(self) -> Iterator[bytes]:
        """Raw reads, each within the idle and total caps (``_last`` moves with each event)."""
        while True:
            now = time.monotonic()
            idle_left = self._last + self._idle_s - now
            total_left = self._start + self.limits.total_s - now
            if total_left <= 0:
                raise WireTimeout(
                    f"a stream that went on past {self.limits.total_s:,.0f} s: kvchat stopped "
                    "reading it"
                )
            if idle_left <= 0:
                raise WireTimeout(
                    f"no event for {self._idle_s:,.0f} s (keep-alives alone do not count)"
                )
            _set_timeout(self._conn, min(idle_left, total_left))
            try:
                part = self._response.read1(65536)
            except TimeoutError:
                # A timed-out socket reads no more: whichever cap was nearer ran out.
                if total_left <= idle_left:
                    raise WireTimeout(
                        f"a stream that went on past {self.limits.total_s:,.0f} s: kvchat "
                        "stopped reading it"
                    ) from None
                raise WireTimeout(
                    f"no event for {self._idle_s:,.0f} s (keep-alives alone do not count)"
                ) from None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise self._broken(exc) from None
            if not part:
                return
            self.bytes_read += len(part)
            if self.bytes_read > self.limits.max_stream_bytes:
                raise WireError(
                    f"a stream larger than {self.limits.max_stream_bytes:,} bytes: kvchat "
                    "stopped reading it"
                )
            yield part

    def __iter__(self) -> Iterator[Any]:
        self._start = self._last = time.monotonic()
        cap = self.limits.max_event_bytes
        pending = b""
        data: list[bytes] = []
        size = 0
        for part in self._chunks():
            pending += part
            while True:
                cut = pending.find(b"\n")
                if cut < 0:
                    if len(pending) > cap:
                        raise WireError(f"a stream line longer than {cap:,} bytes")
                    break
                line, pending = pending[:cut].rstrip(b"\r"), pending[cut + 1 :]
                if line:
                    name, _, value = line.partition(b":")
                    if name in (b"data", b"error"):
                        value = value.removeprefix(b" ")
                        size += len(value) + 1
                        if size > cap:
                            raise WireError(f"a stream event larger than {cap:,} bytes")
                        data.append(value)
                        if name == b"error":
                            payload, data, size = b"\n".join(data), [], 0
                            self._last = time.monotonic()
                            yield {"error": _payload(payload, "an error event", cap)}
                    continue  # a comment (": keep-alive"), an id, an event name: not counted
                if not data:
                    continue
                payload, data, size = b"\n".join(data), [], 0
                if payload.strip() == b"[DONE]":
                    return
                self._last = time.monotonic()
                yield loads(payload, "a stream event", cap)

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def _payload(raw: bytes, what: str, cap: int) -> Any:
    """An ``error:`` event's payload: its JSON, else its text."""
    try:
        return loads(raw, what, cap)
    except WireError:
        return line_of(raw[:MAX_MESSAGE_CHARS].decode("utf-8", "replace"))


@dataclass
class Figures:
    """A turn's prompt figures from the server's ``usage`` and ``timings`` (None: not
    reported, or not believable: ``doubts`` says why)."""

    prompt: int | None = None
    reused: int | None = None
    decoded: int | None = None
    generated: int | None = None
    source: str = ""
    doubts: list[str] = field(default_factory=list)


def figures_from(usage: Usage | None, timings: Timings | None) -> Figures:
    """The server's own counts: ``usage`` (OpenAI's fields) first, llama-server's
    ``timings`` for what usage lacks; nothing is derived but decoded = prompt − cached, and
    a figure that contradicts another (more cached or decoded than the prompt) is dropped."""
    figures = Figures()
    sources = []
    if usage is not None:
        sources.append("usage")
        figures.prompt = usage.prompt_tokens
        figures.generated = usage.completion_tokens
        figures.reused = usage.cached_tokens
        figures.doubts.extend(usage.doubts)
    if timings is not None:
        figures.doubts.extend(timings.doubts)
    if timings is not None and timings.cache_n is not None:
        sources.append("timings")
        cache_n, prompt_n = timings.cache_n, timings.prompt_n
        if figures.prompt is None and prompt_n is not None:
            figures.prompt = cache_n + prompt_n
        if figures.reused is None:
            if figures.prompt is not None and cache_n > figures.prompt:
                figures.doubts.append(
                    f"timings say {cache_n:,} cached of {figures.prompt:,} prompt tokens"
                )
            else:
                figures.reused = cache_n
        if prompt_n is not None:
            if figures.prompt is not None and prompt_n > figures.prompt:
                figures.doubts.append(
                    f"timings say {prompt_n:,} decoded of {figures.prompt:,} prompt tokens"
                )
            else:
                figures.decoded = prompt_n
    if figures.decoded is None and figures.prompt is not None and figures.reused is not None:
        figures.decoded = figures.prompt - figures.reused  # reused ≤ prompt: never negative
    figures.source = "+".join(sources)
    return figures


__all__ = [
    "json_kind",
    "Chunk",
    "EventReader",
    "Figures",
    "ModelEntry",
    "StreamLimits",
    "Timings",
    "Usage",
    "WireError",
    "WireTimeout",
    "clean_text",
    "count",
    "error_message",
    "figures_from",
    "line_of",
    "loads",
    "nesting_depth",
    "parse_chunk",
    "parse_models",
    "parse_slots",
    "parse_timings",
    "parse_usage",
    "read_body",
]
