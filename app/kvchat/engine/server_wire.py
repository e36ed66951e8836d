"""The boundary with llama-server: what its JSON says, as typed and bounded values.

:mod:`kvchat.engine.server_http` reads the bytes (a byte cap, a time cap, bounded JSON:
see :mod:`kvchat.engine.openai_wire`); this module reads the shapes kvchat uses — ``/props``,
``/v1/models``' meta, each event of a ``/completion`` stream, a slot action's figures,
``/tokenize`` and ``/apply-template`` — once, into values whose every field has a type and
a range. A shape that does not fit is a :class:`~kvchat.engine.openai_wire.WireError`
(the client names the server: one line), never a ``KeyError`` or ``OverflowError`` later:

- counts (context size, slots, tokens, bytes) are integers in range (not floats, strings
  or booleans); a figure the engine's bookkeeping rests on that is there but out of range
  is an error, one that is absent is "not said" and the engine assumes the least;
- token ids are integers 0..2^31-1 (what the database stores);
- text is text (lone surrogates replaced), a one-line field is made one visible line;
- log-probabilities (the restore check) are finite floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvchat.engine.openai_wire import (
    MAX_COUNT,
    Timings,
    WireError,
    clean_text,
    json_kind,
    line_of,
    parse_timings,
)

# Slots a server may have (kvchat keeps a few values per slot).
MAX_SLOTS = 4096
# Token ids: what SQLite's packed token lists hold.
MAX_TOKEN_ID = 2**31 - 1
# Tokens in one list the server sends (a tokenization, an event's tokens).
MAX_TOKENS = 4 * 1024 * 1024
# A file size or a byte count (slot files, the model file).
MAX_BYTES = 2**53
# Characters of a path or a build string kvchat keeps.
MAX_PATH_CHARS = 4096
# Top log-probabilities kept per generated token (the restore check asks for a few).
MAX_PROBS = 64


def whole(value: Any, limit: int) -> int | None:
    """``value`` if it is an integer 0..``limit`` (not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit:
        return value
    return None


def figure(holder: Any, name: str, limit: int = MAX_COUNT, *, what: str = "") -> int | None:
    """``holder[name]`` as a count 0..``limit``: None when absent or null; a
    :class:`WireError` when it is there and is not one."""
    if not isinstance(holder, dict) or holder.get(name) is None:
        return None
    value = whole(holder[name], limit)
    if value is None:
        where = f"{what}." if what else ""
        raise WireError(f"{where}{name} {line_of(holder[name], 24)}, not a count")
    return value


def text(holder: Any, name: str, limit: int = MAX_PATH_CHARS, *, line: bool = True) -> str:
    """``holder[name]`` as text ("" when absent or null; a :class:`WireError` when it is
    something else); ``line``: made one visible line of at most ``limit`` characters."""
    if not isinstance(holder, dict) or holder.get(name) is None:
        return ""
    value = holder[name]
    if not isinstance(value, str):
        raise WireError(f"{name} that is {json_kind(value)}, not text")
    if line:
        return line_of(value, limit)
    return clean_text(value)


def token_list(value: Any, what: str) -> list[int]:
    """A list of token ids, each 0..:data:`MAX_TOKEN_ID`."""
    if not isinstance(value, list):
        raise WireError(f"{what} that is {json_kind(value)}, not a list of token ids")
    if len(value) > MAX_TOKENS:
        raise WireError(f"{what} of {len(value):,} tokens")
    tokens = []
    for item in value:
        token = whole(item, MAX_TOKEN_ID)
        if token is None:
            raise WireError(f"{what} with a token id {line_of(item, 24)}")
        tokens.append(token)
    return tokens


# --- /props and /v1/models ----------------------------------------------------------------


@dataclass(frozen=True)
class Props:
    """What kvchat reads of ``/props``."""

    n_ctx: int
    n_slots: int
    model_path: str = ""
    model_alias: str = ""
    model_ftype: str = ""
    build_info: str = ""
    bos_token: str = ""
    eos_token: str = ""


def parse_props(value: Any) -> Props:
    """``/props``: a :class:`WireError` unless it is a llama-server's (it says its context
    size per slot, 1 or more); slots 1..:data:`MAX_SLOTS` (1 when not said)."""
    if not isinstance(value, dict):
        raise WireError(f"props that are {json_kind(value)}, not an object")
    settings = value.get("default_generation_settings")
    if not isinstance(settings, dict):
        raise WireError("props without default_generation_settings (not a llama-server?)")
    n_ctx = figure(settings, "n_ctx", what="default_generation_settings")
    if not n_ctx:
        raise WireError("props that do not say the context size (n_ctx)")
    slots = figure(value, "total_slots", MAX_SLOTS) or 1
    return Props(
        n_ctx=n_ctx,
        n_slots=slots,
        model_path=text(value, "model_path"),
        model_alias=text(value, "model_alias"),
        model_ftype=text(value, "model_ftype", 64),
        build_info=text(value, "build_info", 256),
        bos_token=text(value, "bos_token", 256, line=False),
        eos_token=text(value, "eos_token", 256, line=False),
    )


def parse_model_meta(value: Any) -> dict[str, int]:
    """The first ``/v1/models`` entry's ``meta``: size, n_params, n_vocab (each a count, 0
    when not said or not a count: a server that says nothing is told apart by its model
    path and build)."""
    meta: Any = {}
    if isinstance(value, dict) and isinstance(value.get("data"), list) and value["data"]:
        first = value["data"][0]
        if isinstance(first, dict) and isinstance(first.get("meta"), dict):
            meta = first["meta"]
    return {name: whole(meta.get(name), MAX_BYTES) or 0 for name in ("size", "n_params", "n_vocab")}


# --- /completion events ---------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One event of a ``/completion`` stream."""

    content: str = ""
    tokens: list[int] = field(default_factory=list)
    stop: bool = False
    stop_type: str = ""
    truncated: bool = False
    progress: bool = False  # a prompt-progress report (its tokens are placeholders)
    tokens_cached: int | None = None
    tokens_predicted: int | None = None
    timings: Timings | None = None
    # Per generated token: its top (token id, log-probability) pairs, when asked.
    probs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None


def _flag(holder: dict[str, Any], name: str) -> bool:
    value = holder.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WireError(f"an event whose {name} is {json_kind(value)}, not true or false")
    return value


def _probs(value: Any) -> list[list[tuple[int, float]]]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_PROBS:
        raise WireError("completion_probabilities that are not a short list")
    out = []
    for entry in value:
        top = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(top, list) or len(top) > MAX_PROBS:
            raise WireError("completion_probabilities without a short top_logprobs list")
        pairs = []
        for item in top:
            token = whole(item.get("id"), MAX_TOKEN_ID) if isinstance(item, dict) else None
            logprob = item.get("logprob") if isinstance(item, dict) else None
            if (
                token is None
                or not isinstance(logprob, int | float)
                or isinstance(logprob, bool)
                or not math.isfinite(logprob)
            ):
                raise WireError(f"a top log-probability {line_of(item, 40)}")
            pairs.append((token, float(logprob)))
        out.append(pairs)
    return out


def parse_event(value: Any) -> Event:
    """One ``/completion`` event (an ``error`` one: its message as one line)."""
    if not isinstance(value, dict):
        raise WireError(f"a stream event that is {json_kind(value)}, not an object")
    if value.get("error") is not None:
        error = value["error"]
        message = error.get("message") if isinstance(error, dict) else error
        return Event(error=line_of(message if message is not None else error) or "an error")
    content = value.get("content")
    if content is not None and not isinstance(content, str):
        raise WireError(f"an event whose content is {json_kind(content)}, not text")
    tokens = value.get("tokens")
    progress = value.get("prompt_progress") is not None
    return Event(
        content=clean_text(content or ""),
        tokens=[] if tokens is None or progress else token_list(tokens, "an event's tokens"),
        stop=_flag(value, "stop"),
        stop_type=text(value, "stop_type", 24),
        truncated=_flag(value, "truncated"),
        progress=progress,
        tokens_cached=figure(value, "tokens_cached"),
        tokens_predicted=figure(value, "tokens_predicted"),
        timings=_timings(value.get("timings")),
        probs=_probs(value.get("completion_probabilities")),
    )


def _timings(value: Any) -> Timings | None:
    timings = parse_timings(value)
    if timings is not None and timings.doubts:
        raise WireError(f"timings with {timings.doubts[0].removeprefix('timings.')}")
    if value is not None and not isinstance(value, dict):
        raise WireError(f"timings that are {json_kind(value)}, not an object")
    return timings


# --- slot actions, /tokenize, /apply-template ----------------------------------------------------


def slot_figures(value: Any, *names: str) -> dict[str, int]:
    """A slot action's figures (``n_saved``, ``n_written``, ``n_restored``, ``n_read``): each a
    count, -1 when not said (a figure that is there and not a count: a WireError)."""
    if not isinstance(value, dict):
        raise WireError(f"a slot action's answer that is {json_kind(value)}, not an object")
    out = {}
    for name in names:
        found = figure(value, name, MAX_BYTES, what="the slot action's")
        out[name] = -1 if found is None else found
    return out


def tokenized(value: Any) -> list[int]:
    """``/tokenize``'s ``tokens`` as plain ids."""
    if not isinstance(value, dict):
        raise WireError(f"a tokenization that is {json_kind(value)}, not an object")
    return token_list(value.get("tokens", []), "a tokenization")


def tokenized_pieces(value: Any) -> list[tuple[int, str]]:
    """``/tokenize``'s ``tokens`` with ``with_pieces``: (id, piece) pairs (a piece that is
    not text, e.g. bytes of a partial character, comes as "")."""
    if not isinstance(value, dict):
        raise WireError(f"a tokenization that is {json_kind(value)}, not an object")
    items = value.get("tokens", [])
    if not isinstance(items, list) or len(items) > MAX_TOKENS:
        raise WireError("a tokenization whose tokens are not a list")
    pairs = []
    for item in items:
        token = whole(item.get("id"), MAX_TOKEN_ID) if isinstance(item, dict) else None
        if token is None:
            raise WireError(f"a tokenization with a token {line_of(item, 40)}")
        piece = item.get("piece")
        pairs.append((token, clean_text(piece) if isinstance(piece, str) else ""))
    return pairs


def rendered(value: Any) -> str:
    """``/apply-template``'s ``prompt``."""
    if not isinstance(value, dict):
        raise WireError(f"a rendering that is {json_kind(value)}, not an object")
    prompt = value.get("prompt")
    if not isinstance(prompt, str):
        raise WireError(f"a rendering whose prompt is {json_kind(prompt)}, not text")
    return clean_text(prompt)
