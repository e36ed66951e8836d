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
    GenerationParams,
    GenerationStats,
    KvSpec,
    PrefillResult,
    SlotEngine,
    TokenEngine,
    WholeContext,
    common_prefix,
)
from kvchat.engine.openai_wire import WireError
from kvchat.engine.server_http import EventStream, ServerClient, ServerError
from kvchat.engine.server_markup import ServerPrompts
from kvchat.engine.server_wire import (
    Event,
    parse_event,
    parse_model_meta,
    parse_props,
    slot_figures,
)
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
# A restore check (see ServerEngine.kv_check): probe tokens read after the restored KV, and
# the top log-probabilities of the next token compared with those the KV gave when saved.
CHECK_TOKENS = 64
CHECK_PROBS = 16


def batched_prefix(decoded: int, align: int, ubatch: int = SERVER_UBATCH) -> int:
    """Of ``decoded`` tokens the server decodes in one request (from an aligned start), how
    many leading ones get a full prefill's KV: all but a last piece of one token, and with
    ``align`` > 1 all but the last piece's rows past a multiple of ``align``."""
    if decoded <= 0:
        return 0
    last = decoded % ubatch or ubatch
    tail = last % align if align > 1 else int(last == 1)
    return decoded - tail


class ServerEngine:
    """A llama-server's slot as the context (implements :class:`kvchat.engine.Engine`)."""

    def __init__(self, config: EngineConfig, url: str, api_key: str | None = None) -> None:
        self.client = ServerClient(url, api_key)
        try:
            self.info = parse_props(self.client.get("/props"))
        except WireError as exc:
            raise ServerError(
                f"{self.client.url} does not answer like a llama-server (/props: {exc.what})"
            ) from None
        # What the rest of kvchat reads of the props: parsed, bounded values only.
        self.props: dict[str, Any] = {
            "model_path": self.info.model_path,
            "model_alias": self.info.model_alias,
            "model_ftype": self.info.model_ftype,
            "build_info": self.info.build_info,
            "bos_token": self.info.bos_token,
            "eos_token": self.info.eos_token,
            "total_slots": self.info.n_slots,
        }
        try:
            self.model_meta: dict[str, int] = parse_model_meta(self.client.get("/v1/models"))
        except ServerError:
            self.model_meta = parse_model_meta(None)
        self.n_ctx: int = self.info.n_ctx
        self.n_slots: int = self.info.n_slots
        model_path = self.info.model_path
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
        self.prompts = ServerPrompts(self.client, self.props)
        ftype = self.info.model_ftype
        self.batch_align = 1 if ftype.startswith(_UNPACKED_FTYPES) else REPACK_ROWS
        self.metadata: dict[str, str] = {}  # the GGUF is the server's to read
        self.template_options: dict[str, object] = {}  # the server's template takes none
        self._cuts = WholeContext()
        # The server_slot_dir setting (see kvchat.kvcache.server_tiers.ServerSlots).
        self.slot_dir_setting: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, config: EngineConfig) -> ServerEngine:
        """The engine for ``settings.server_url`` (and ``server_api_key``)."""
        if not settings.server_url:
            raise KvchatError(
                "engine llama-server needs a server URL: --server URL, KVCHAT_SERVER_URL "
                "or server_url in the config file"
            )
        engine = cls(config, settings.server_url, settings.server_api_key)
        engine.slot_dir_setting = settings.server_slot_dir
        return engine

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
            "model_path": self.info.model_path,
            "model_size": self.model_meta["size"],
            "n_params": self.model_meta["n_params"],
            "n_vocab": self.model_meta["n_vocab"],
            "build_info": self.info.build_info,
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

    def slot_save(self, filename: str) -> dict[str, int]:
        """Save the current slot to ``filename`` in the server's --slot-save-path; its
        figures ``n_saved`` and ``n_written`` (-1: not said)."""
        result = self._slot_action("save", {"filename": filename})
        return self._figures(result, "n_saved", "n_written")

    def slot_restore(self, filename: str) -> dict[str, int]:
        """Load ``filename`` into the current slot; the slot then holds the file's tokens
        (on failure the server empties the slot). Its figures ``n_restored`` and
        ``n_read`` (-1: not said)."""
        self._tokens = []
        self._exact = 0
        result = self._slot_action("restore", {"filename": filename})
        return self._figures(result, "n_restored", "n_read")

    def _figures(self, result: Any, *names: str) -> dict[str, int]:
        try:
            return slot_figures(result, *names)
        except WireError as exc:
            raise self.client._bad_reply(exc.what, "/slots") from None

    def slot_erase(self) -> None:
        self._tokens = []
        self._exact = 0
        self._slot_action("erase", {})

    def _slot_action(self, action: str, body: dict[str, Any]) -> Any:
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
        return result

    def kv_check(
        self, tokens: Sequence[int], probe: Sequence[int] | None = None
    ) -> tuple[list[int], list[tuple[int, float]]]:
        """What the slot's KV for ``tokens`` (held in full) gives: ``probe`` tokens (by
        default :data:`CHECK_TOKENS` of ``tokens`` spread over them, last first) are read
        after it in one batch, and the top :data:`CHECK_PROBS` log-probabilities of the
        next token come back, with the probe. Every cell of the KV is attended to by each
        probe token, so KV that differs anywhere gives other figures (the KV stays on the
        server: this is how kvchat looks at it). Raises ServerError when the server did not
        reuse exactly ``tokens``. The slot then holds ``tokens`` + the probe; the exact part
        does not change."""
        tokens = list(tokens)
        if probe is None:
            k = min(CHECK_TOKENS, len(tokens))
            probe = [tokens[(i * len(tokens)) // k] for i in reversed(range(k))]
        probe = list(probe)
        if not tokens or not probe or len(tokens) + len(probe) + 1 >= self.n_ctx:
            raise ServerError(f"no room in the server's context to check {len(tokens):,} tokens")
        body = self._body([*tokens, *probe], 1, temperature=0.0, top_k=1, n_probs=CHECK_PROBS)
        body["cache_prompt"] = True
        body["samplers"] = ["top_k"]
        exact = self._exact
        final: Event | None = None
        top: list[tuple[int, float]] = []
        try:
            for event in self._run(body, None):
                if event.probs and not top:
                    top = event.probs[0]
                if event.stop:
                    final = event
        except ServerError:
            self._tokens, self._exact = [], 0
            raise
        self._tokens = tokens + probe
        self._exact = min(exact, len(tokens))
        self._beyond = False
        reused = final.timings.cache_n if final is not None and final.timings else None
        if reused != len(tokens):
            self._tokens, self._exact = [], 0
            raise ServerError(
                f"llama-server at {self.client.url} reused {reused} of the {len(tokens):,} "
                "tokens its slot should hold"
            )
        return probe, top

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

    def _run(self, body: dict[str, Any], cancel: CancelCheck | None) -> Iterator[Event]:
        """The events of one completion up to its last (``stop``), each parsed and bounded
        (:func:`kvchat.engine.server_wire.parse_event`); closes the stream on cancel or when
        dropped. A stream that ends before its last event, or sends what kvchat cannot
        read, is one :class:`ServerError` line."""
        stream: EventStream = self.client.stream("/completion", body)
        self._fresh = False
        try:
            for raw in stream:
                try:
                    event = parse_event(raw)
                except WireError as exc:
                    raise self.client._bad_reply(exc.what) from None
                if event.error is not None:
                    raise ServerError(f"llama-server at {self.client.url}: {event.error}")
                yield event
                if event.stop or (cancel is not None and cancel()):
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
                if event.stop:
                    final = event
        except ServerError:
            self._tokens, self._exact = [], 0
            raise
        if final is None:  # cancelled: the server stops when the stream closes
            self._tokens = prompt[:start]
            self._exact = min(exact_before, start)
            self._beyond = True
            return PrefillResult(prompt=len(prompt), reused=start, decoded=0)
        timings = final.timings
        cache_n = timings.cache_n if timings is not None else None
        prompt_n = timings.prompt_n if timings is not None else None
        cached = final.tokens_cached if final.tokens_cached is not None else len(prompt)
        self._tokens = prompt[: min(cached, len(prompt))]
        self._beyond = False
        if cache_n is None or cache_n > len(prompt) or (prompt_n or 0) > len(prompt) - cache_n:
            # Figures not said or that cannot be: kvchat vouches for none of the slot's KV
            # (the next turn re-reads it) and reports what it asked for.
            self._exact = 0
            return PrefillResult(prompt=len(prompt), reused=0, decoded=len(prompt))
        reused = cache_n
        decoded = prompt_n if prompt_n is not None else len(prompt) - reused
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
        final: Event | None = None
        started = time.perf_counter()
        stats.finish_reason = "cancelled"
        try:
            for event in self._run(self._body(prompt, budget, **sampling), cancel):
                # A progress report carries a placeholder token (0), not a reply's: parsed
                # as no tokens.
                produced += event.tokens
                text = event.content
                if event.stop:
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
        stop = final.stop_type
        # The server counts the end-of-generation token; the local engine does not.
        predicted = final.tokens_predicted
        if predicted is None:
            predicted = len(produced)  # not said: what came
        predicted = min(predicted, budget + 1)  # never more than it was asked for
        stats.generated = max(0, predicted - (stop == "eos"))
        timings = final.timings
        if timings is not None and timings.predicted_per_second:
            stats.tokens_per_s = timings.predicted_per_second
        if final.truncated or len(prompt) + stats.generated + 1 >= self.n_ctx:
            stats.finish_reason = "context" if stop != "eos" else "stop"
        else:
            stats.finish_reason = "length" if stop == "limit" else "stop"
        cached = final.tokens_cached
        if cached is None:
            cached = len(prompt) + len(produced)
        self._tokens = (prompt + produced)[:cached]
        reused = timings.cache_n if timings is not None else None
        if reused is None or reused < len(prompt) - 1:
            # The slot changed since the prefill (another client), or the server did not
            # say: vouch for no more than it says it reused.
            self._exact = min(self._exact, reused or 0)

    # --- where the context can be cut: anywhere (no sliding window kept here) -------------

    def reuse_point(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        return self._cuts.reuse_point(held, prompt)

    def restore_floor(self, n_tokens: int) -> int:
        return self._cuts.restore_floor(n_tokens)

    @property
    def window_floor(self) -> int:
        return self._cuts.window_floor

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        return self._cuts.take_checkpoints()

    def held_checkpoint(self, limit: int) -> int:
        return self._cuts.held_checkpoint(limit)

    def kv_spec(self) -> KvSpec | None:
        """None: the KV bytes stay on the server, kvchat never parses them."""
        return None

    def chunk_problem(self) -> str | None:
        return None

    def generate_aside(self, prompt: Sequence[int], max_tokens: int) -> str | None:
        """Nothing: no scratch sequence here (a server's slot holds the conversation)."""
        return None

    def measure_threads(
        self, counts: Sequence[int], prompt: int = 32, generate: int = 8
    ) -> dict[str, dict[str, float]]:
        """Nothing: the server's thread counts are its own."""
        return {}

    # --- roles (see kvchat.engine.api.Engine) ------------------------------------------------

    def token_level(self) -> TokenEngine:
        return self

    def seq_state(self) -> None:
        """None: the KV bytes stay on the server (see kvchat.kvcache.server_tiers)."""
        return None

    def server_slots(self) -> SlotEngine:
        return self

    def remote_chat(self) -> None:
        return None

    def close(self) -> None:
        """Nothing to release: the server keeps running (and keeps its slots)."""
