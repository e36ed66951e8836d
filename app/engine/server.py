"""The llama-server engine: the model runs in a llama-server, here or on another machine.

The server's own tokenizer and chat template are used (``/tokenize``, ``/apply-template``);
prompts go to ``/completion`` as token ids with ``cache_prompt``, so the server reuses the
longest common prefix of what its slot holds, and its figures (``timings.cache_n``,
``timings.prompt_n``) are the turn's reused and decoded counts. One slot at a time is this
engine's context; :mod:`kvchat.kvcache.slots` says which, and saves and restores slot
files per session. Cancel = close the stream. Not thread-safe, like every engine.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.engine.base import (
    CancelCheck,
    EngineCapabilities,
    EngineConfig,
    GenerationParams,
    GenerationStats,
    PrefillResult,
)
from kvchat.engine.server_http import EventStream, ServerClient, ServerError
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import Settings

# Cached tokenizations and renderings (the service asks for the same prefixes often).
_CACHE_ENTRIES = 2048


class ServerEngine:
    """A llama-server's slot as the context (implements :class:`kvchat.engine.Engine`)."""

    def __init__(self, config: EngineConfig, url: str, api_key: str | None = None) -> None:
        self.client = ServerClient(url, api_key)
        props = self.client.get("/props")
        if not isinstance(props, dict) or "default_generation_settings" not in props:
            raise ServerError(f"{self.client.url} does not answer like a llama-server (/props)")
        self.props = props
        try:
            listed = self.client.get("/v1/models")
            self.model_meta: dict[str, Any] = dict(listed["data"][0].get("meta") or {})
        except (ServerError, KeyError, IndexError, TypeError, AttributeError):
            self.model_meta = {}
        self.n_ctx: int = int(props["default_generation_settings"].get("n_ctx") or 0)
        self.n_slots: int = max(1, int(props.get("total_slots") or 1))
        model_path = str(props.get("model_path") or "")
        self.config = replace(config, model_path=Path(model_path), n_ctx=self.n_ctx)
        self.slot = 0
        self._tokens: list[int] = []
        # The next request must not reuse what the slot holds (a cleared context).
        self._fresh = False
        self._prompt: list[int] = []
        self._text_cache: dict[tuple[str, bool], list[int]] = {}
        self._render_cache: dict[str, str] = {}
        self._specials: dict[str, int] = {}
        self._specials_pattern: re.Pattern[str] | None = None
        self._learned: set[str] = set()
        self._bos: list[int] | None = None
        self._slot_id = secrets.token_hex(8)
        self._marker = f"\ue000{self._slot_id}:"
        self._markers = re.compile(re.escape(self._marker) + r"(\d+)\ue001")

    @classmethod
    def from_settings(cls, settings: Settings, config: EngineConfig) -> ServerEngine:
        """The engine for ``settings.server_url`` (and ``server_api_key``)."""
        if not settings.server_url:
            raise KvchatError(
                "engine llama-server needs a server URL: --server URL, KVCHAT_SERVER_URL "
                "or server_url in the config file"
            )
        return cls(config, settings.server_url, settings.server_api_key)

    # --- identity -------------------------------------------------------------------------

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(seq_state=False, can_shift=False, server_slots=True)

    @property
    def model_name(self) -> str:
        alias = str(self.props.get("model_alias") or self.props.get("model_path") or "")
        return Path(alias).stem if alias.endswith(".gguf") else alias or "llama-server"

    @property
    def server_url(self) -> str:
        return self.client.url

    def identity(self) -> dict[str, Any]:
        """What a slot file's KV depends on, as this server reports it: the model file (path
        and size), the build, the context per slot. llama-server does not report its KV
        types; a slot file of other types fails to load (a prefill, with the reason)."""
        return {
            "model_path": str(self.props.get("model_path") or ""),
            "model_size": int(self.model_meta.get("size") or 0),
            "n_params": int(self.model_meta.get("n_params") or 0),
            "n_vocab": int(self.model_meta.get("n_vocab") or 0),
            "build_info": str(self.props.get("build_info") or ""),
            "n_ctx": self.n_ctx,
        }

    def layout(self) -> dict[str, Any]:
        """The server's identity (the KV bytes stay on the server: kvchat never parses them)."""
        return {**self.identity(), "server": self.client.url, "n_slots": self.n_slots}

    def kv_shape(self) -> tuple[int, int, int] | None:
        return None

    # --- slots ------------------------------------------------------------------------------

    def use_slot(self, slot: int, tokens: Sequence[int]) -> None:
        """Make ``slot`` the context; ``tokens``: what kvchat last knew it to hold."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} of {self.n_slots}")
        self.slot = slot
        self._tokens = list(tokens)
        self._fresh = False

    def slot_save(self, filename: str) -> dict[str, Any]:
        """Save the current slot to ``filename`` in the server's --slot-save-path."""
        return self._slot_action("save", {"filename": filename})

    def slot_restore(self, filename: str) -> dict[str, Any]:
        """Load ``filename`` into the current slot; the slot then holds the file's tokens
        (on failure the server empties the slot)."""
        self._tokens = []
        return self._slot_action("restore", {"filename": filename})

    def slot_erase(self) -> None:
        self._tokens = []
        self._slot_action("erase", {})

    def _slot_action(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            result = self.client.post(f"/slots/{self.slot}?action={action}", body)
        except ServerError as exc:
            if exc.status == 501 or "slot-save-path" in str(exc):
                raise ServerError(
                    f"llama-server at {self.client.url} keeps no slot files: start it with "
                    "--slot-save-path DIR (`kvchat server` prints a command line)",
                    exc.status,
                ) from None
            raise
        return result if isinstance(result, dict) else {}

    # --- tokens ---------------------------------------------------------------------------

    def _tokenize(self, text: str, parse_special: bool) -> list[int]:
        key = (text, parse_special)
        cached = self._text_cache.get(key)
        if cached is not None:
            return list(cached)
        if not text:
            return []
        reply = self.client.post(
            "/tokenize",
            {"content": text, "add_special": False, "parse_special": parse_special},
        )
        tokens = [int(t) for t in reply.get("tokens", [])]
        if len(self._text_cache) >= _CACHE_ENTRIES:
            self._text_cache.clear()
        self._text_cache[key] = tokens
        return list(tokens)

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text (``parse_special`` false): a control token's spelling stays characters."""
        return self._tokenize(text, parse_special=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The server's chat template over ``messages``, ending with the assistant's opening."""
        body = {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
        key = repr(body)
        cached = self._render_cache.get(key)
        if cached is not None:
            return cached
        try:
            reply = self.client.post("/apply-template", body)
        except ServerError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status != 401:
                raise KvchatError(
                    f"the server's chat template refused these messages: {exc}"
                ) from None
            raise
        prompt = str(reply.get("prompt", ""))
        if len(self._render_cache) >= _CACHE_ENTRIES:
            self._render_cache.clear()
        self._render_cache[key] = prompt
        return prompt

    def _learn_specials(self, markup: str) -> None:
        """Find the control tokens the template's markup spells (``<|im_start|>`` …): the
        tokens of ``markup`` read with ``parse_special`` whose spelling, read as text, is
        not that one token. Asked once per distinct piece of markup and token."""
        if markup in self._learned or not markup:
            return
        self._learned.add(markup)
        reply = self.client.post(
            "/tokenize",
            {"content": markup, "add_special": False, "parse_special": True, "with_pieces": True},
        )
        changed = False
        for item in reply.get("tokens", []):
            piece = item.get("piece") if isinstance(item, dict) else None
            if not isinstance(piece, str) or len(piece) < 2 or piece in self._learned:
                continue
            self._learned.add(piece)
            token = int(item["id"])
            if self._tokenize(piece, parse_special=False) != [token]:
                self._specials[piece] = token
                changed = True
        if changed:
            spellings = sorted(self._specials, key=len, reverse=True)
            self._specials_pattern = re.compile("|".join(map(re.escape, spellings)))

    def _split_markup(self, text: str) -> Iterator[tuple[str, int | None]]:
        """``(text, None)`` for plain text and ``(spelling, id)`` for a control token."""
        pattern = self._specials_pattern
        if pattern is None:
            yield text, None
            return
        at = 0
        for match in pattern.finditer(text):
            if match.start() > at:
                yield text[at : match.start()], None
            yield match.group(), self._specials[match.group()]
            at = match.end()
        if at < len(text):
            yield text[at:], None

    def _bos_tokens(self, rendered: str) -> list[int]:
        """[BOS] when the vocabulary adds one and the rendering does not spell it."""
        if self._bos is None:
            reply = self.client.post(
                "/tokenize", {"content": "", "add_special": True, "parse_special": True}
            )
            self._bos = [int(t) for t in reply.get("tokens", [])][:1]
        spelling = str(self.props.get("bos_token") or "")
        if not self._bos or (spelling and rendered.startswith(spelling)):
            return []
        return list(self._bos)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``: only the template's own markup makes control tokens.

        As the local engine does: the template is rendered with a marker in place of each
        message's content, cut at the markers; the markup is split at control-token
        spellings (learned from the server) and the text between two control tokens
        (markup and message content together) is tokenized as text. So a pasted
        ``<|im_end|>`` is characters, never the end of a turn. Deterministic.
        """
        contents = [str(m.get("content") or "") for m in messages]
        stand_ins = [{**m, "content": f"{self._marker}{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.render(stand_ins)
        pieces = self._markers.split(rendered)
        found = {int(index) for index in pieces[1::2]}
        if found != set(range(len(messages))) or any(self._slot_id in p for p in pieces[::2]):
            raise KvchatError(
                "the server's chat template changes message text: kvchat cannot keep "
                "control tokens out of it (start llama-server with another --chat-template)"
            )
        for markup in pieces[::2]:
            self._learn_specials(markup)
        tokens = self._bos_tokens(rendered)
        run: list[str] = []
        for index, piece in enumerate(pieces):
            if index % 2:
                run.append(contents[int(piece)])
                continue
            for text, special in self._split_markup(piece):
                if special is None:
                    run.append(text)
                    continue
                tokens += self.tokenize("".join(run))
                tokens.append(special)
                run = []
        tokens += self.tokenize("".join(run))
        return tokens

    @property
    def tokens(self) -> list[int]:
        """The token ids kvchat knows the slot to hold (the server matches on its own copy)."""
        return list(self._tokens)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    # --- context --------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget the slot's KV: the next request re-reads its whole prompt."""
        self._tokens = []
        self._fresh = True

    def _body(self, prompt: Sequence[int], n_predict: int, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt),
            "id_slot": self.slot,
            "cache_prompt": not self._fresh,
            "n_predict": n_predict,
            "stream": True,
            "return_tokens": True,
            "return_progress": True,
            "samplers": ["top_k", "top_p", "min_p", "temperature"],
        }
        body.update(extra)
        return body

    def _run(self, body: dict[str, Any], cancel: CancelCheck | None) -> Iterator[dict[str, Any]]:
        """The events of one completion; closes the stream on cancel or when dropped."""
        stream: EventStream = self.client.stream("/completion", body)
        self._fresh = False
        try:
            for event in stream:
                if "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise ServerError(f"llama-server at {self.client.url}: {message}")
                yield event
                if cancel is not None and cancel():
                    return
        finally:
            stream.close()

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        """Have the server bring ``prompt`` into the slot (it decodes what its cache lacks).

        A ``/completion`` with ``n_predict`` 0: the server's figures are the result. A
        prompt cut short by ``cancel`` reports fewer tokens than the prompt.
        """
        prompt = list(prompt)
        if len(prompt) >= self.n_ctx:
            raise KvchatError(
                f"the prompt ({len(prompt):,} tokens) does not fit the server's context ({self.n_ctx:,})"
            )
        self._prompt = prompt
        final = None
        try:
            for event in self._run(self._body(prompt, 0, temperature=0.0), cancel):
                if event.get("stop"):
                    final = event
        except ServerError:
            self._tokens = []
            raise
        if final is None:  # cancelled: the server stops processing when the stream closes
            self._tokens = []
            self._fresh = True
            return PrefillResult(prompt=len(prompt), reused=0, decoded=0)
        timings = final.get("timings") or {}
        reused = int(timings.get("cache_n", 0))
        decoded = int(timings.get("prompt_n", len(prompt) - reused))
        cached = int(final.get("tokens_cached", len(prompt)))
        self._tokens = prompt[: min(cached, len(prompt))]
        return PrefillResult(prompt=len(prompt), reused=reused, decoded=decoded)

    def settle(self, keep: int, tokens: Sequence[int], cancel: CancelCheck | None = None) -> int:
        """Make the slot hold ``tokens``, re-reading everything after position ``keep`` as
        one batch (as a full prefill would have read it, not token by token).

        The server reuses its longest common prefix, so a first request whose token at
        ``keep`` differs cuts the slot back there; the second reads the rest."""
        tokens = list(tokens)
        keep = min(keep, len(tokens), self.n_tokens)
        if keep < len(tokens) and keep > 0:
            other = 0 if tokens[keep] != 0 else 1
            self.prefill([*tokens[:keep], other])
        return self.prefill(tokens, cancel).decoded

    def generate(
        self, params: GenerationParams, stats: GenerationStats, cancel: CancelCheck | None = None
    ) -> Iterator[str]:
        """Stream the reply to the prompt last prefilled; the slot then holds prompt + reply."""
        prompt = self._prompt
        sampling: dict[str, Any] = {
            "temperature": max(0.0, params.temperature),
            "top_k": params.top_k if params.temperature > 0 else 1,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "seed": params.seed & 0xFFFFFFFF,
        }
        budget = max(1, min(params.max_tokens, self.n_ctx - len(prompt) - 1))
        produced: list[int] = []
        final: dict[str, Any] | None = None
        started = time.perf_counter()
        stats.finish_reason = "cancelled"
        try:
            for event in self._run(self._body(prompt, budget, **sampling), cancel):
                produced += [int(t) for t in event.get("tokens") or []]
                text = event.get("content") or ""
                if event.get("stop"):
                    final = event
                if text:
                    if stats.ttft_ms is None:
                        stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                    yield text
                if final is not None:
                    break
        except ServerError:
            self._tokens = []
            raise
        finally:
            elapsed = time.perf_counter() - started
            if final is None:
                # Cancelled: the slot holds the prompt and some of the reply; which part
                # is not known, so kvchat assumes no more than the prompt.
                self._tokens = list(prompt)
                stats.generated = len(produced)
            if stats.generated and elapsed > 0 and stats.tokens_per_s is None:
                stats.tokens_per_s = stats.generated / elapsed
        if final is None:
            return
        stop = final.get("stop_type")
        # The server counts the end-of-generation token; the local engine does not.
        stats.generated = int(final.get("tokens_predicted", len(produced))) - (stop == "eos")
        timings = final.get("timings") or {}
        if timings.get("predicted_per_second"):
            stats.tokens_per_s = float(timings["predicted_per_second"])
        if final.get("truncated") or len(prompt) + stats.generated + 1 >= self.n_ctx:
            stats.finish_reason = "context" if stop != "eos" else "stop"
        else:
            stats.finish_reason = "length" if stop == "limit" else "stop"
        cached = int(final.get("tokens_cached", len(prompt) + len(produced)))
        self._tokens = (prompt + produced)[: max(0, cached)]

    def can_shift(self) -> bool:
        return False

    def shift(self, start: int, end: int) -> int:
        raise KvchatError("the llama-server engine does not shift KV: the kept window is re-read")

    # --- sequence state: the bytes stay on the server (see kvchat.kvcache.slots) ----------

    def state_size(self) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_buffer(self, size: int) -> Any:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_get(self) -> memoryview:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_save_file(self, path: Path) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_load_file(self, path: Path) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def close(self) -> None:
        """Nothing to release: the server keeps running (and keeps its slots)."""
