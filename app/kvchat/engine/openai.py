"""Any OpenAI-compatible server as the engine: ``/v1/chat/completions``, streamed.

The server applies its own chat template and tokenizer and keeps its own KV cache, so this
engine takes whole messages, not token ids (``capabilities.remote_chat``): the service
sends the conversation and shows the server's own figures for the turn — the cached prompt
tokens it reports (``usage.prompt_tokens_details.cached_tokens``, llama-server's
``timings.cache_n``/``prompt_n``), or that it reported none. The KV is the server's: kvchat
saves and restores no snapshot of it.

Each request is built so the server can reuse the last one's prefix: the same messages in
the same order with the same fields (role, content; no timestamps), the sampling fields
after them. Session affinity where the server has it: llama-server gets ``id_slot`` (one
slot per session, by its id) and ``cache_prompt``; every server gets ``prompt_cache_key``
(the session id, OpenAI's own field). ``chat_template_kwargs`` (``enable_thinking``) goes
only when the session chose thinking on or off. The key is read from
``KVCHAT_OPENAI_API_KEY`` (or the settings) and sent as a bearer token, never shown.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.engine.api import (
    CancelCheck,
    EngineCapabilities,
    EngineConfig,
    GenerationParams,
    GenerationStats,
    RemoteChatEngine,
)
from kvchat.engine.openai_wire import (
    MAX_EMPTY_EVENTS,
    REQUEST_TOTAL_S,
    Chunk,
    EventReader,
    Figures,
    ModelEntry,
    StreamLimits,
    Timings,
    Usage,
    WireError,
    WireTimeout,
    figures_from,
    loads,
    parse_chunk,
    parse_models,
    parse_slots,
    parse_timings,
    parse_usage,
    read_body,
)
from kvchat.engine.server_http import (
    ReplyRead,
    ServerClient,
    ServerError,
    answered,
    normalize_url,
)
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import Settings

# Where the KV is, said wherever kvchat would show its own tiers.
REMOTE_KV_NOTE = "the KV cache is the server's, not kvchat's: no snapshot is saved or restored"


@dataclass(frozen=True)
class OpenAIDialect:
    """An OpenAI-compatible server, for :class:`ServerClient`: named as such, its key refused
    with HTTP 401 or 403, watched from before its connection opens, and every reply read
    through :mod:`kvchat.engine.openai_wire` within its time cap and named by its path: what
    the server sends is never parsed anywhere else."""

    label: str = "the OpenAI-compatible server"

    def refused(self, url: str, status: int, raw: bytes) -> ServerError:
        if status in (401, 403):
            return ServerError(
                f"{self.label} at {url} refused the API key (HTTP {status}): set "
                "KVCHAT_OPENAI_API_KEY to the key it expects",
                status,
            )
        return answered(self.label, url, status, raw)

    def watch(self, conn: http.client.HTTPConnection, timeout: float) -> Callable[[], None]:
        # The answer's status line and headers must come within ``timeout`` in all (a
        # server that sends them a byte at a time is cut off): a watchdog shuts the socket.
        watchdog = threading.Timer(timeout, _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        return watchdog.cancel

    def reply(self, path: str, timeout: float) -> ReplyRead:
        return ReplyRead(total_s=min(timeout, REQUEST_TOTAL_S), what=f"a reply to {path}", where="")


def openai_client(url: str, api_key: str | None = None) -> ServerClient:
    """A :class:`ServerClient` for the OpenAI-compatible server at ``url``."""
    return ServerClient(url, api_key, OpenAIDialect())


def chat_stream(client: ServerClient, path: str, body: Any, limits: StreamLimits) -> ReplyStream:
    """POST ``body`` and read the reply: server-sent events, or one JSON completion from a
    server that does not stream (close it to cancel)."""
    conn, response = client.send("POST", path, body, limits.idle_s)
    kind = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
    if kind == "application/json":
        return ReplyStream(client, conn, response, limits, whole=True)
    return ReplyStream(client, conn, response, limits)


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ReplyStream:
    """The events of one reply, each a parsed, bounded JSON value; any failure a
    :class:`ServerError` naming the server (a time cap: :class:`StreamTimeout`)."""

    def __init__(
        self,
        client: ServerClient,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        limits: StreamLimits,
        whole: bool = False,
    ) -> None:
        self._client = client
        self._conn = conn
        self._response = response
        self._limits = limits
        self._whole = whole
        self._reader = EventReader(conn, response, limits, client.broken)

    def finished(self) -> None:
        """The reply is whole: wait no longer than a few seconds for its figures."""
        self._reader.finished()

    def __iter__(self) -> Iterator[Any]:
        try:
            if self._whole:
                try:
                    raw = read_body(self._conn, self._response, total_s=self._limits.idle_s)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    raise self._client.broken(exc) from None
                yield loads(raw, "a completion")
                return
            yield from self._reader
        except WireTimeout as exc:
            raise StreamTimeout(f"{self._client.label} at {self._client.url}: {exc.what}") from None
        except WireError as exc:
            raise self._client.sent(exc.what) from None

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class StreamTimeout(ServerError):
    """A stream ran past one of its time caps."""


# The figures and chunk types, as this module has always named them.
ServerFigures = Figures
ChunkRead = Chunk


def read_chunk(event: Any) -> Chunk:
    """The reasoning and answer text, finish reason and figures of one
    ``chat.completion.chunk`` (see :func:`kvchat.engine.openai_wire.parse_chunk`)."""
    return parse_chunk(event)


def figures_of(
    usage: Usage | dict[str, Any] | None, timings: Timings | dict[str, Any] | None
) -> Figures:
    """The server's own counts (see :func:`kvchat.engine.openai_wire.figures_from`);
    ``usage`` and ``timings`` typed, or as the server's JSON objects."""
    if not isinstance(usage, Usage | None):
        usage = parse_usage(usage)
    if not isinstance(timings, Timings | None):
        timings = parse_timings(timings)
    return figures_from(usage, timings)


class OpenAIEngine:
    """Chat completions on an OpenAI-compatible server (implements
    :class:`kvchat.engine.Engine` in the role of :class:`kvchat.engine.RemoteChatEngine`:
    :meth:`chat` runs a turn; it has no token-level role)."""

    def __init__(
        self, config: EngineConfig, url: str, api_key: str | None = None, model: str | None = None
    ) -> None:
        self.client = openai_client(url, api_key)
        self.url = self.client.url
        first = ModelEntry()
        try:
            first = parse_models(self.client.get("/models"))
        except WireError as exc:
            if model is None:
                raise self.client.sent(exc.what) from None
        except ServerError as exc:
            if exc.status in (401, 403) or model is None:
                raise
        self.model_id = model or first.id
        if not self.model_id:
            raise ServerError(
                f"{self.client.label} at {self.url} lists no model: set openai_model "
                "(KVCHAT_OPENAI_MODEL) to the one to use"
            )
        # llama-server says who it is in its model list; it then takes id_slot/cache_prompt.
        self.llama_server = first.owned_by == "llamacpp"
        self.n_ctx: int = first.n_ctx  # 0: the server does not say
        self.n_slots = self._llama_slots(api_key) if self.llama_server else 0
        self.config = replace(config, model_path=Path(self.model_id), n_ctx=self.n_ctx)
        # The bytes of the last request body, exactly as sent (for byte-stability checks).
        self.last_request: bytes = b""
        self.figures = ServerFigures()
        # The caps of a reply's stream (see kvchat.engine.openai_wire).
        self.limits = StreamLimits()

    @classmethod
    def from_settings(cls, settings: Settings, config: EngineConfig) -> OpenAIEngine:
        """The engine for ``settings.openai_url`` (key: ``openai_api_key``)."""
        if not settings.openai_url:
            raise KvchatError(
                "engine openai needs a server URL: --openai URL, KVCHAT_OPENAI_URL or "
                "openai_url in the config file (e.g. http://127.0.0.1:8080/v1)"
            )
        return cls(config, settings.openai_url, settings.openai_api_key, settings.openai_model)

    def _llama_slots(self, api_key: str | None) -> int:
        """llama-server's slot count (its ``/props`` beside ``/v1``); 0 when unknown."""
        root = self.url.removesuffix("/v1")
        try:
            return parse_slots(openai_client(root, api_key).get("/props"))
        except KvchatError:
            return 0

    # --- identity -------------------------------------------------------------------------

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(remote_chat=True)

    @property
    def model_name(self) -> str:
        name = self.model_id
        return Path(name).stem if name.endswith(".gguf") else name

    def layout(self) -> dict[str, Any]:
        return {"server": self.url, "model": self.model_id}

    def kv_shape(self) -> tuple[int, int, int] | None:
        return None

    @property
    def note(self) -> str:
        """Where the model runs, one line for the status bar."""
        return f"OpenAI-compatible server {self.url} · {self.model_name} · {REMOTE_KV_NOTE}"

    # --- a turn -----------------------------------------------------------------------------

    def request_body(
        self,
        messages: Sequence[dict[str, str]],
        params: GenerationParams,
        session_id: str,
        think: bool | None = None,
    ) -> dict[str, Any]:
        """The request: the model and the messages first, in a fixed field order, so the
        bytes of one turn's request are a prefix of the next one's up to its last message."""
        body: dict[str, Any] = {
            "model": self.model_id,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": params.max_tokens,
            "temperature": max(0.0, params.temperature),
            "top_p": params.top_p,
            "seed": params.seed & 0x7FFFFFFF,
            "prompt_cache_key": session_id,
        }
        if self.llama_server:
            body["cache_prompt"] = True
            if self.n_slots:
                body["id_slot"] = zlib.crc32(session_id.encode()) % self.n_slots
        if think is not None:
            body["chat_template_kwargs"] = {"enable_thinking": think}
        return body

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: GenerationParams,
        stats: GenerationStats,
        session_id: str,
        think: bool | None = None,
        cancel: CancelCheck | None = None,
    ) -> Iterator[tuple[str, str]]:
        """Stream the reply as ``("reasoning" | "answer", text)`` pieces; afterwards
        :attr:`figures` holds the server's counts and ``stats`` its finish reason.

        Everything the server sends is read through :mod:`kvchat.engine.openai_wire`; what
        kvchat cannot read, a time cap, or a server that goes on past ``max_tokens`` (each
        piece of text is at least one token) ends the reply with a :class:`ServerError`, one
        line, after the pieces already yielded: the caller keeps those as a partial reply.
        """
        body = self.request_body(messages, params, session_id, think)
        self.last_request = json.dumps(body).encode("utf-8")  # as ServerClient sends it
        self.figures = ServerFigures()
        stats.finish_reason = "cancelled"
        started = time.perf_counter()
        stream = chat_stream(self.client, "/chat/completions", body, self.limits)
        usage: Usage | None = None
        timings: Timings | None = None
        finished: str | None = None
        ended = False
        pieces = empty = 0
        after = ""
        answered = False
        try:
            try:
                for event in stream:
                    try:
                        read = parse_chunk(event)
                    except WireError as exc:
                        raise self.client.sent(exc.what) from None
                    if read.error is not None:
                        raise ServerError(f"{self.client.label} at {self.url}: {read.error}")
                    usage = read.usage or usage
                    timings = read.timings or timings
                    if not (read.reasoning or read.content):
                        empty += 1
                        if empty > MAX_EMPTY_EVENTS:
                            raise self.client.sent(
                                f"{empty:,} stream events without text: kvchat stopped reading"
                            )
                    elif finished is not None:
                        ended = True  # the server said the reply was finished: it was
                        break
                    else:
                        pieces += 1
                        if pieces > max(1, params.max_tokens):
                            raise self.client.sent(
                                f"more than max_tokens ({params.max_tokens:,}) pieces of text: "
                                "kvchat stopped reading"
                            )
                    if read.reasoning and answered:
                        # Shown after the answer it would be neither stored nor shown as
                        # reasoning: the reply ends at the answer so far.
                        raise self.client.sent("reasoning after the answer had begun")
                    answered = answered or bool(read.content)
                    if read.finish_reason and finished is None:
                        finished = read.finish_reason
                        stream.finished()  # only the figures may still come
                    for kind, text in (("reasoning", read.reasoning), ("answer", read.content)):
                        if text:
                            if stats.ttft_ms is None:
                                stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                            yield kind, text
                    if cancel is not None and cancel():
                        break
                    if finished is not None and read.usage is not None:
                        ended = True  # the last chunk (stream_options.include_usage)
                        break
                else:
                    ended = True
            except ServerError as exc:
                if finished is None:
                    raise
                # The reply was whole; what came after it (its figures) is not shown.
                ended = True
                after = f"after the reply's end, {exc}"
        finally:
            stream.close()
            elapsed = time.perf_counter() - started
            self.figures = figures_of(usage, timings)
            if after:
                self.figures.doubts.append(after)
            stats.generated = self.figures.generated or 0
            if stats.generated and elapsed > 0:
                stats.tokens_per_s = stats.generated / elapsed
        if timings is not None and timings.predicted_n and timings.predicted_per_second:
            stats.tokens_per_s = timings.predicted_per_second
        if not ended:
            return  # cancelled: the finish reason stays "cancelled"
        if finished is None:
            raise ServerError(
                f"{self.client.label} at {self.url} broke off the reply (did it stop?)",
                dropped=True,
            )
        stats.finish_reason = "length" if finished == "length" else "stop"

    # --- what is the server's own -------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """0, the store's "not counted": the server's tokenizer is not kvchat's to run."""
        return 0

    # --- roles (see kvchat.engine.api.Engine): whole messages only ---------------------------

    def token_level(self) -> None:
        """None: the server renders the template and tokenizes on its side."""
        return None

    def seq_state(self) -> None:
        """None: the KV is the server's (REMOTE_KV_NOTE)."""
        return None

    def server_slots(self) -> None:
        return None

    def remote_chat(self) -> RemoteChatEngine:
        return self

    def close(self) -> None:
        """Nothing to release: the server keeps running."""


__all__ = [
    "ChunkRead",
    "OpenAIDialect",
    "OpenAIEngine",
    "REMOTE_KV_NOTE",
    "ServerFigures",
    "figures_of",
    "chat_stream",
    "normalize_url",
    "openai_client",
    "read_chunk",
]
