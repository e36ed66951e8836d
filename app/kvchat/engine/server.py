"""The llama-server engine: the model runs in a llama-server, here or on another machine.

The server's own tokenizer and chat template are used (``/tokenize``, ``/apply-template``);
prompts go to ``/completion`` as token ids with ``cache_prompt``, so the server reuses the
longest common prefix of what its slot holds, and its figures (``timings.cache_n``,
``timings.prompt_n``) are the turn's reused and decoded counts. One slot at a time is this
engine's context; :mod:`kvchat.kvcache.server_tiers` says which, and saves and restores slot
files per session. Cancel = close the stream. Not thread-safe, like every engine.

Greedy equality with a full prefill: llama.cpp computes a token's KV slightly differently
when it is decoded alone (each generated token; the last prompt token, which the server
decodes again to get the logits) than inside a batch, and with repacked weights also where in
a batch of four it falls. So the engine keeps count of how many leading tokens of the slot
hold exactly the KV a full prefill computes (:attr:`ServerEngine.exact`), and never lets the
server reuse more than that: a longer match is first cut back with a one-token request
(:meth:`ServerEngine._cut`). The settle after a reply re-reads the reply that way, so a saved
slot file holds a full prefill's KV and a restored session replies as a fresh one does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
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
    common_prefix,
)
from kvchat.engine.server_http import EventStream, ServerClient, ServerError
from kvchat.engine.server_markup import ServerPrompts
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import Settings

# llama-server's physical batch (-ub, its default): a prompt is decoded in pieces this long,
# and a piece of one token is a single-token decode.
SERVER_UBATCH = 512
# Model file types whose weights llama.cpp's CPU backend never repacks (see
# kvchat.engine.llama_spec.REPACKED_TYPES): any other type's batches must start on
# multiples of four for a token's KV to be a full prefill's.
_UNPACKED_FTYPES = ("F32", "F16", "BF16", "Q4_1", "Q5_0", "Q5_1")
REPACK_ROWS = 4


def batched_prefix(decoded: int, align: int, ubatch: int = SERVER_UBATCH) -> int:
    """Of ``decoded`` tokens the server decodes in one request (from an aligned start), how
    many leading ones get a full prefill's KV: all but a last piece of one token, and with
    ``align`` > 1 all but the last piece's rows past a multiple of ``align``."""
    if decoded <= 0:
        return 0
    last = decoded % ubatch or ubatch
    tail = last % align if align > 1 else int(last == 1)
    return decoded - tail


class ServerEngine(EngineDefaults):
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
        # Leading tokens of _tokens whose KV is what a full prefill computes (see the module).
        self._exact = 0
        # The slot may hold more than _tokens (a cancelled reply: which tokens, unknown).
        self._beyond = False
        # The next request must not reuse what the slot holds (a cleared context).
        self._fresh = False
        self._prompt: list[int] = []
        self.prompts = ServerPrompts(self.client, props)
        ftype = str(props.get("model_ftype") or "")
        self.batch_align = 1 if ftype.startswith(_UNPACKED_FTYPES) else REPACK_ROWS

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

    def use_slot(self, slot: int, tokens: Sequence[int], exact: int = 0) -> None:
        """Make ``slot`` the context; ``tokens``: what kvchat last knew it to hold, the first
        ``exact`` of them with a full prefill's KV (see :attr:`exact`)."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} of {self.n_slots}")
        self.slot = slot
        self._tokens = list(tokens)
        self._exact = max(0, min(exact, len(self._tokens)))
        self._beyond = False
        self._fresh = False

    @property
    def exact(self) -> int:
        """How many leading tokens of :attr:`tokens` hold exactly the KV a full prefill of
        them computes (the rest was generated token by token, or decoded alone)."""
        return self._exact

    def slot_save(self, filename: str) -> dict[str, Any]:
        """Save the current slot to ``filename`` in the server's --slot-save-path."""
        return self._slot_action("save", {"filename": filename})

    def slot_restore(self, filename: str) -> dict[str, Any]:
        """Load ``filename`` into the current slot; the slot then holds the file's tokens
        (on failure the server empties the slot)."""
        self._tokens = []
        self._exact = 0
        return self._slot_action("restore", {"filename": filename})

    def slot_erase(self) -> None:
        self._tokens = []
        self._exact = 0
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

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text (``parse_special`` false): a control token's spelling stays characters."""
        return self.prompts.tokenize(text)

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.tokenize(text))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The server's chat template over ``messages``, ending with the assistant's opening."""
        return self.prompts.render(messages)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``; a pasted ``<|im_end|>`` stays text (see
        :meth:`kvchat.engine.server_markup.ServerPrompts.chat_tokens`)."""
        return self.prompts.chat_tokens(messages)

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
        self._exact = 0
        self._beyond = False
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
        """The events of one completion up to its last (``stop``); closes the stream on
        cancel or when dropped. A stream that ends before its last event is an error."""
        stream: EventStream = self.client.stream("/completion", body)
        self._fresh = False
        try:
            for event in stream:
                if "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise ServerError(f"llama-server at {self.client.url}: {message}")
                yield event
                if event.get("stop") or (cancel is not None and cancel()):
                    return
            raise ServerError(
                f"llama-server at {self.client.url} broke off the reply (did it stop?)"
            )
        finally:
            stream.close()

    def _reuse_point(self, prompt: Sequence[int], limit: int | None = None) -> int:
        """Where the server should start decoding ``prompt``: the common prefix with what
        the slot holds, no further than its exact part (and ``limit``), on a multiple of
        :attr:`batch_align`."""
        if self._fresh:
            return 0
        point = min(common_prefix(self._tokens, prompt), self._exact, len(prompt))
        if limit is not None:
            point = min(point, limit)
        return point - point % self.batch_align

    def _cut(self, prompt: Sequence[int], point: int) -> None:
        """Make the server reuse no more than ``prompt[:point]`` on the next request.

        The server reuses the longest common prefix of its slot and a request: a request
        for ``prompt[:point]`` and then a token other than ``prompt[point]`` leaves the
        slot holding exactly that (the one token decoded alone is never reused)."""
        if point <= 0:
            self._tokens, self._exact, self._beyond, self._fresh = [], 0, False, True
            return
        other = 0 if prompt[point] != 0 else 1
        body = self._body([*prompt[:point], other], 0, temperature=0.0)
        body["cache_prompt"] = True
        try:
            for _event in self._run(body, None):
                pass
        except ServerError:
            self._tokens, self._exact = [], 0
            raise
        self._tokens = list(prompt[:point])
        self._exact = min(self._exact, point)
        self._beyond = False

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        """Have the server bring ``prompt`` into the slot (it decodes what its cache lacks).

        A ``/completion`` with ``n_predict`` 0: the server's figures are the result. The
        server reuses no more than the slot's exact part (a longer match is cut back first,
        see :meth:`_cut`). Cut short by ``cancel`` (checked between the server's progress
        reports), it reports what was reused, and kvchat counts on no more than that.
        """
        return self._prefill(list(prompt), cancel, None)

    def _prefill(
        self, prompt: list[int], cancel: CancelCheck | None, limit: int | None
    ) -> PrefillResult:
        if len(prompt) >= self.n_ctx:
            raise KvchatError(
                f"the prompt ({len(prompt):,} tokens) does not fit the server's context "
                f"({self.n_ctx:,})"
            )
        self._prompt = prompt
        start = self._reuse_point(prompt, limit)
        could = len(prompt) if self._beyond else common_prefix(self._tokens, prompt)
        if not self._fresh and start < min(could, len(prompt)):
            self._cut(prompt, start)
        result = self._read(prompt, start, cancel)
        if result.reused > start:
            # The server matched more than kvchat knew the slot to hold (another process
            # used the slot): KV nobody vouches for. Cut it back and read again.
            self._cut(prompt, start)
            result = self._read(prompt, start, cancel)
        return result

    def _read(self, prompt: list[int], start: int, cancel: CancelCheck | None) -> PrefillResult:
        """One ``/completion`` with ``n_predict`` 0 for ``prompt``: the server's figures."""
        exact_before = self._exact
        final = None
        try:
            for event in self._run(self._body(prompt, 0, temperature=0.0), cancel):
                if event.get("stop"):
                    final = event
        except ServerError:
            self._tokens, self._exact = [], 0
            raise
        if final is None:  # cancelled: the server stops when the stream closes
            self._tokens = prompt[:start]
            self._exact = min(exact_before, start)
            self._beyond = True
            return PrefillResult(prompt=len(prompt), reused=start, decoded=0)
        timings = final.get("timings") or {}
        reused = int(timings.get("cache_n", 0))
        decoded = int(timings.get("prompt_n", len(prompt) - reused))
        cached = int(final.get("tokens_cached", len(prompt)))
        self._tokens = prompt[: min(cached, len(prompt))]
        self._beyond = False
        self._exact = self._exact_after(exact_before, reused, decoded, len(self._tokens))
        return PrefillResult(prompt=len(prompt), reused=reused, decoded=decoded)

    def _exact_after(self, before: int, reused: int, decoded: int, held: int) -> int:
        """The slot's exact part after a request that reused ``reused`` tokens (of which
        ``before`` were exact) and decoded ``decoded`` more in one go."""
        if reused > before or reused % self.batch_align:
            return min(before, reused, held)
        return min(held, reused + batched_prefix(decoded, self.batch_align))

    def settle(self, keep: int, tokens: Sequence[int], cancel: CancelCheck | None = None) -> int:
        """Make the slot hold ``tokens``, re-reading everything after position ``keep`` (and
        after the slot's exact part) as one batch, as a full prefill reads it, not token by
        token as it was generated.

        A first request cuts the slot back there (see :meth:`_cut`); the second reads the
        rest, unless ``cancel`` says stop. Returns the tokens decoded."""
        tokens = list(tokens)
        point = self._reuse_point(tokens, keep)
        could = len(tokens) if self._beyond else common_prefix(self._tokens, tokens)
        if not self._fresh and point < min(could, len(tokens)):
            self._cut(tokens, point)
        if cancel is not None and cancel():
            return 0
        return self._prefill(tokens, cancel, keep).decoded

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
                if "prompt_progress" not in event:
                    # A progress report carries a placeholder token (0), not a reply's.
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
            self._tokens, self._exact = [], 0
            raise
        finally:
            elapsed = time.perf_counter() - started
            # The server decoded the last prompt token again, alone, for its logits.
            self._exact = min(self._exact, max(0, len(prompt) - 1))
            if final is None:
                # Cancelled: the slot holds the prompt and some of the reply; which part
                # is not known, so kvchat assumes no more than the prompt.
                self._tokens = list(prompt)
                self._beyond = True
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
        reused = int(timings.get("cache_n", 0))
        if reused < len(prompt) - 1:  # the slot changed since the prefill (another client)
            self._exact = min(self._exact, reused)

    def can_shift(self) -> bool:
        return False

    def shift(self, start: int, end: int) -> int:
        raise KvchatError("the llama-server engine does not shift KV: the kept window is re-read")

    # --- sequence state: the bytes stay on the server (see kvchat.kvcache.server_tiers) ----------

    def state_size(self) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_buffer(self, size: int) -> Any:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_get(self) -> memoryview:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_append(self, buf: Any, size: int, below: int) -> bool:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_adopt(self, tokens: Sequence[int]) -> bool:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_save_file(self, path: Path) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def state_load_file(self, path: Path) -> int:
        raise NotImplementedError("llama-server keeps its KV: use slot files")

    def close(self) -> None:
        """Nothing to release: the server keeps running (and keeps its slots)."""
