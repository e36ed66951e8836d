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

import json
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.engine.api import (
    CancelCheck,
    EngineCapabilities,
    EngineConfig,
    EngineDefaults,
    GenerationParams,
    GenerationStats,
    PrefillResult,
)
from kvchat.engine.server_http import ServerClient, ServerError, normalize_url
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import Settings

# Where the KV is, said wherever kvchat would show its own tiers.
REMOTE_KV_NOTE = "the KV cache is the server's, not kvchat's: no snapshot is saved or restored"
_NO_TOKENS = "an OpenAI-compatible server tokenizes on its side: kvchat has no token ids here"


class OpenAIClient(ServerClient):
    """:class:`ServerClient` whose one-line errors name an OpenAI-compatible server."""

    label = "the OpenAI-compatible server"

    def _refused(self, status: int, raw: bytes) -> ServerError:
        if status in (401, 403):
            return ServerError(
                f"{self.label} at {self.url} refused the API key (HTTP {status}): set "
                "KVCHAT_OPENAI_API_KEY to the key it expects",
                status,
            )
        return super()._refused(status, raw)


@dataclass
class ServerFigures:
    """A turn's prompt figures as the server reported them (None: not reported)."""

    prompt: int | None = None
    reused: int | None = None
    decoded: int | None = None
    generated: int | None = None
    # Which of the server's fields they came from ("usage", "timings", "usage+timings", "").
    source: str = ""


@dataclass
class ChunkRead:
    """What one streamed chunk carries."""

    reasoning: str = ""
    content: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None


def read_chunk(event: dict[str, Any]) -> ChunkRead:
    """The reasoning and answer text, finish reason and figures of one ``chat.completion.chunk``."""
    read = ChunkRead()
    if "error" in event:
        error = event["error"]
        read.error = str(error.get("message") if isinstance(error, dict) else error)
        return read
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if isinstance(delta, dict):
            read.reasoning += str(delta.get("reasoning_content") or delta.get("reasoning") or "")
            read.content += str(delta.get("content") or "")
        if choice.get("finish_reason"):
            read.finish_reason = str(choice["finish_reason"])
    usage = event.get("usage")
    read.usage = usage if isinstance(usage, dict) else None
    timings = event.get("timings")
    read.timings = timings if isinstance(timings, dict) else None
    return read


def figures_of(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> ServerFigures:
    """The server's own counts: ``usage`` (OpenAI's fields) first, llama-server's ``timings``
    for what usage lacks; nothing is derived but decoded = prompt − cached."""
    figures = ServerFigures()
    sources = []
    if usage:
        sources.append("usage")
        figures.prompt = _int(usage.get("prompt_tokens"))
        figures.generated = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            figures.reused = _int(details.get("cached_tokens"))
    if timings and (_int(timings.get("cache_n")) is not None):
        sources.append("timings")
        cache_n, prompt_n = _int(timings.get("cache_n")), _int(timings.get("prompt_n"))
        if figures.reused is None:
            figures.reused = cache_n
        figures.decoded = prompt_n
        if figures.prompt is None and cache_n is not None and prompt_n is not None:
            figures.prompt = cache_n + prompt_n
    if figures.decoded is None and figures.prompt is not None and figures.reused is not None:
        figures.decoded = figures.prompt - figures.reused
    figures.source = "+".join(sources)
    return figures


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class OpenAIEngine(EngineDefaults):
    """Chat completions on an OpenAI-compatible server (implements
    :class:`kvchat.engine.Engine` with ``capabilities.remote_chat``: the token-level members
    have nothing to work on and say so; :meth:`chat` runs a turn)."""

    def __init__(
        self, config: EngineConfig, url: str, api_key: str | None = None, model: str | None = None
    ) -> None:
        self.client = OpenAIClient(url, api_key)
        self.url = self.client.url
        listed: Any = None
        try:
            listed = self.client.get("/models")
        except ServerError as exc:
            if exc.status in (401, 403) or model is None:
                raise
        entries = listed.get("data") if isinstance(listed, dict) else None
        first = entries[0] if isinstance(entries, list) and entries else {}
        first = first if isinstance(first, dict) else {}
        self.model_id = model or str(first.get("id") or "")
        if not self.model_id:
            raise ServerError(
                f"the {OpenAIClient.label} at {self.url} lists no model: set openai_model "
                "(KVCHAT_OPENAI_MODEL) to the one to use"
            )
        # llama-server says who it is in its model list; it then takes id_slot/cache_prompt.
        self.llama_server = first.get("owned_by") == "llamacpp"
        meta = first.get("meta") if isinstance(first.get("meta"), dict) else {}
        self.n_ctx: int = _int(meta.get("n_ctx")) or 0  # 0: the server does not say
        self.n_slots = self._llama_slots(api_key) if self.llama_server else 0
        self.config = replace(config, model_path=Path(self.model_id), n_ctx=self.n_ctx)
        # The bytes of the last request body, exactly as sent (for byte-stability checks).
        self.last_request: bytes = b""
        self.figures = ServerFigures()

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
            props = OpenAIClient(root, api_key).get("/props")
        except KvchatError:
            return 0
        return (_int(props.get("total_slots")) or 0) if isinstance(props, dict) else 0

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
        :attr:`figures` holds the server's counts and ``stats`` its finish reason."""
        body = self.request_body(messages, params, session_id, think)
        self.last_request = json.dumps(body).encode("utf-8")  # as ServerClient sends it
        self.figures = ServerFigures()
        stats.finish_reason = "cancelled"
        started = time.perf_counter()
        stream = self.client.stream("/chat/completions", body)
        usage: dict[str, Any] | None = None
        timings: dict[str, Any] | None = None
        finished: str | None = None
        ended = False
        pieces = 0
        try:
            for event in stream:
                read = read_chunk(event)
                if read.error is not None:
                    raise ServerError(f"the {OpenAIClient.label} at {self.url}: {read.error}")
                usage = read.usage or usage
                timings = read.timings or timings
                finished = read.finish_reason or finished
                for kind, text in (("reasoning", read.reasoning), ("answer", read.content)):
                    if text:
                        pieces += 1
                        if stats.ttft_ms is None:
                            stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                        yield kind, text
                if cancel is not None and cancel():
                    break
            else:
                ended = True
        finally:
            stream.close()
            elapsed = time.perf_counter() - started
            self.figures = figures_of(usage, timings)
            stats.generated = self.figures.generated or 0
            if stats.generated and elapsed > 0:
                stats.tokens_per_s = stats.generated / elapsed
        if timings and _int(timings.get("predicted_n")) and timings.get("predicted_per_second"):
            stats.tokens_per_s = float(timings["predicted_per_second"])
        if not ended:
            return  # cancelled: the finish reason stays "cancelled"
        if finished is None:
            raise ServerError(
                f"the {OpenAIClient.label} at {self.url} broke off the reply (did it stop?)",
                dropped=True,
            )
        stats.finish_reason = "length" if finished == "length" else "stop"

    # --- the token-level members: the server's own ----------------------------------------

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        raise KvchatError("an OpenAI-compatible server applies its chat template on its side")

    def tokenize(self, text: str) -> list[int]:
        raise KvchatError(_NO_TOKENS)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        raise KvchatError(_NO_TOKENS)

    def count_tokens(self, text: str) -> int:
        """0, the store's "not counted": the server's tokenizer is not kvchat's to run."""
        return 0

    @property
    def tokens(self) -> list[int]:
        return []

    @property
    def n_tokens(self) -> int:
        return 0

    def clear(self) -> None:
        """Nothing here: the server's cache is its own."""

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        raise KvchatError(_NO_TOKENS)

    def settle(self, keep: int, tokens: Sequence[int], cancel: CancelCheck | None = None) -> int:
        return 0

    def generate(
        self, params: GenerationParams, stats: GenerationStats, cancel: CancelCheck | None = None
    ) -> Iterator[str]:
        raise KvchatError("an OpenAI-compatible server takes messages: see OpenAIEngine.chat")

    def can_shift(self) -> bool:
        return False

    def shift(self, start: int, end: int) -> int:
        raise KvchatError("an OpenAI-compatible server's KV is not kvchat's to shift")

    def state_size(self) -> int:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_buffer(self, size: int) -> Any:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_get(self) -> memoryview:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_append(self, buf: Any, size: int, below: int) -> bool:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_adopt(self, tokens: Sequence[int]) -> bool:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_save_file(self, path: Path) -> int:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def state_load_file(self, path: Path) -> int:
        raise NotImplementedError(REMOTE_KV_NOTE)

    def close(self) -> None:
        """Nothing to release: the server keeps running."""


__all__ = [
    "ChunkRead",
    "OpenAIClient",
    "OpenAIEngine",
    "REMOTE_KV_NOTE",
    "ServerFigures",
    "figures_of",
    "normalize_url",
    "read_chunk",
]
