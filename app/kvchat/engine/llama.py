"""The local llama.cpp engine: one llama.cpp context holding one conversation (sequence 0).

The engine keeps the exact token ids that are in the context, so a new prompt reuses
the longest common prefix and only its suffix is decoded. It knows nothing of
sessions, SQLite or snapshot files: it hands out and accepts raw seq-state bytes.
Not thread-safe: the caller runs every method on one thread.

Beside this module: :mod:`.llama_markup` (messages → prompt tokens, control tokens only
from the template), :mod:`.llama_state` (seq-state bytes, state files, window
checkpoints) and :mod:`.llama_spec` (what the KV cache holds per layer).
"""

from __future__ import annotations

import codecs
import ctypes
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import llama_cpp
from llama_cpp import _internals as internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.llama_grammar import LlamaGrammar

from kvchat.engine.api import (
    CancelCheck,
    EngineCapabilities,
    EngineConfig,
    GenerationParams,
    GenerationStats,
    KvSpec,
    PrefillResult,
    SeqStateEngine,
    TokenEngine,
    common_prefix,
)
from kvchat.engine.llama_markup import ChatTokens
from kvchat.engine.llama_spec import read_spec, uniform_shape
from kvchat.engine.llama_state import (
    PARAMS_LOCK,
    SCRATCH_SEQ,
    SEQ_ID,
    ContextState,
    scratch_sequence,
)
from kvchat.errors import KvchatError
from kvchat.planner.templates import CHATML, ChosenTemplate, catalog_template, choose_template

if TYPE_CHECKING:
    from kvchat.config import Settings

# llama_cpp's sampler chain class is untyped; made through this typed name.
_NEW_SAMPLER = cast(Callable[[], Any], internals.LlamaSampler)
# Prefill is decoded in slices this long so a cancel request is honoured between them.
PREFILL_SLICE = 128
# llama.cpp's CPU flash attention over an f16 cache runs a tiled kernel for batches of at
# least this many tokens and a one-chunk kernel below, and the two give other KV for the
# same tokens (a batch of 64 vs 40 + 24 differ; any split below 64 agree): with that cache,
# batches stay below it (see LlamaEngine.prefill_slice), so a resumed turn's KV is what a
# full prefill's is.
FA_TILE_ROWS = 64
# Rows of the tiles of llama.cpp's AMX kernels (weight repacking on an AMX CPU).
AMX_ROWS = 16
# The smallest batch decoded (see LlamaEngine.prefill).
MIN_BATCH = 2
# Thread counts are measured again after a slow reply at most this often.
RECHECK_EVERY_S = 60.0

GGML_TYPES: dict[str, int] = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


# Used when a GGUF carries no chat template and nothing else chooses one (see
# kvchat.planner.templates): ChatML, which most small instruct models speak.
CHATML_TEMPLATE = CHATML


def llama_arguments(config: EngineConfig) -> dict[str, Any]:
    """llama-cpp-python's ``Llama`` arguments for ``config``: how kvchat's engine loads a
    model, and how the bench's llama-cpp-python peer loads the same one."""
    return {
        "model_path": str(config.model_path),
        "n_ctx": config.n_ctx,
        "n_batch": config.n_batch,
        "n_ubatch": config.n_batch,
        "n_threads": config.n_threads,
        "n_threads_batch": config.n_threads_batch or config.n_threads,
        "n_gpu_layers": config.n_gpu_layers,
        "type_k": GGML_TYPES[config.type_k],
        "type_v": GGML_TYPES[config.type_v],
        "flash_attn": config.flash_attn,
        # Sliding-window layers keep a window's worth of cells (pad256(n_swa + n_ubatch)),
        # not n_ctx: a cut below what they hold loads a window checkpoint (see
        # window_floor). swa_full = true keeps every cell.
        "swa_full": config.swa_full,
        "seed": config.seed,
        "verbose": False,
    }


class LlamaEngine:
    """A loaded model and its one context (implements :class:`kvchat.engine.Engine` in the
    roles of :class:`kvchat.engine.TokenEngine` and :class:`kvchat.engine.SeqStateEngine`).

    It holds its helpers: :class:`ChatTokens` (messages → prompt tokens) and
    :class:`ContextState` (the KV as bytes, state files, window checkpoints)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.type_v != "f16" and not config.flash_attn:
            raise KvchatError(
                f"a quantized V cache (type_v={config.type_v}) needs flash attention: "
                "set flash_attn = true or keep type_v = f16"
            )
        if config.repack is None:
            from kvchat.engine.probe import probed_config

            config, _ = probed_config(config, in_use=True)
            self.config = config
        try:
            with scratch_sequence(_scratch_wanted(config)), weight_repack(bool(config.repack)):
                self.llm = llama_cpp.Llama(**llama_arguments(config))
        except (ValueError, RuntimeError) as exc:
            raise KvchatError(f"could not load model {config.model_path}: {exc}") from exc
        self.ctx = self.llm._ctx.ctx
        self.n_ctx: int = llama_cpp.llama_n_ctx(self.ctx)
        self.metadata: dict[str, str] = dict(self.llm.metadata)
        self.template_options: dict[str, object] = {}
        self._vocab = self.llm._model.vocab
        try:
            self.template: ChosenTemplate = choose_template(
                config.chat_template,
                self.metadata.get("tokenizer.chat_template"),
                catalog_template(config.model_path),
            )
            self._formatter = Jinja2ChatFormatter(
                template=self.template.text,
                eos_token=self._piece(self.llm.token_eos()),
                bos_token=self._piece(self.llm.token_bos()),
                add_generation_prompt=True,
            )
        except KvchatError:
            self.llm.close()
            raise
        except Exception as exc:  # jinja2's TemplateSyntaxError and friends
            self.llm.close()
            raise KvchatError(
                f"the chat template {self.template.name} is not valid: {exc}"
            ) from exc
        model = self.llm._model.model
        self.n_swa = int(llama_cpp.llama_model_n_swa(model))
        # Recurrent layers (Mamba, LFM2's short convolutions, Gated DeltaNet...) keep one
        # state per sequence, for its last position only: no cut below the end without a
        # checkpoint of that state (llama.cpp's partial state, as for windows).
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        # Whether a cut inside a sliding-window ring that has wrapped leaves the KV a full
        # prefill would have. Not with weight repacking on an AMX CPU (llama.cpp's extra
        # buffer types there): measured on the tiny Gemma 3, Gemma 2 and gpt-oss models, a cut
        # at the floor differed from a full prefill in 2-58 bytes and Gemma 3's 64-token greedy
        # reply differed, while a loaded window checkpoint or a decode from the start were
        # exact. There the ring is never cut: see window_floor.
        self.ring_cuts_exact = not (config.repack and _has_amx())
        self._spec: KvSpec | None = None
        self._spec_problem: str | None = None
        self._read_spec()
        # Sliding-window models: window checkpoints taken at message boundaries (see
        # ContextState.capture), and the state bytes in and out.
        self._state = ContextState(
            self.llm, self.n_swa, self.recurrent, self.interleaved, config.n_gpu_layers
        )
        self._chat = ChatTokens(self._vocab, self.render, self.tokenize, self._bos_before)
        self.prefill_slice = PREFILL_SLICE
        if self._one_chunk_attention():
            # A multiple of the batch alignment (see _cuts), below the tile.
            self.prefill_slice = FA_TILE_ROWS - max(4, self.batch_align)
        # Thread counts re-measured after a slow reply (see _watch_speed): when, how often.
        self._rechecked_at = -RECHECK_EVERY_S
        self.slowdowns = 0

    @classmethod
    def from_settings(cls, settings: Settings, config: EngineConfig) -> LlamaEngine:
        """The engine on ``config`` (the settings' own, or the probe's choice)."""
        return cls(config)

    def _one_chunk_attention(self) -> bool:
        """Whether batches must stay below :data:`FA_TILE_ROWS` tokens: flash attention on
        over an f16 cache held by the CPU (measured: ~23% slower prefill at 1,500 tokens on
        2 cores, for a resume that equals a full prefill)."""
        config = self.config
        on_gpu = self.gpu_offload and config.n_gpu_layers != 0
        return config.flash_attn and config.type_k == config.type_v == "f16" and not on_gpu

    # --- identity -------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.metadata.get("general.name") or self.config.model_path.stem

    @property
    def gpu_offload(self) -> bool:
        return bool(llama_cpp.llama_supports_gpu_offload())

    @property
    def capabilities(self) -> EngineCapabilities:
        """Asked each time: whether the cache can shift is known only once the context exists."""
        return EngineCapabilities(
            seq_state=True,
            can_shift=self.can_shift(),
            gpu_offload=self.gpu_offload,
            appends_state=self.appends_state,
            window_checkpoints=self.interleaved,
        )

    def layout(self) -> dict[str, Any]:
        """Settings that decide the KV bytes' meaning; a snapshot must match all of them."""
        arch = self.metadata.get("general.architecture", "")
        model = self.llm._model.model
        return {
            "type_k": self.config.type_k,
            "type_v": self.config.type_v,
            "flash_attn": self.config.flash_attn,
            "rope_freq_base": float(self.metadata.get(f"{arch}.rope.freq_base", 0.0) or 0.0),
            "rope_freq_scale": float(llama_cpp.llama_model_rope_freq_scale_train(model)),
            "n_swa": self.n_swa,
            "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        }

    def kv_shape(self) -> tuple[int, int, int] | None:
        """(layers, K width, V width) per token and layer, or None when layers differ."""
        n_layer = int(llama_cpp.llama_model_n_layer(self.llm._model.model))
        return uniform_shape(self.metadata, n_layer)

    def _read_spec(self) -> None:
        """What the model's KV cache holds per layer, or why it cannot be cut into chunks."""
        reading = read_spec(self.config.model_path, self.metadata, self.llm._model.model)
        self._spec, self._spec_problem, self.batch_align = reading
        if not self.config.repack:
            self.batch_align = 1  # weights in their file layout: no four-row kernels
        elif _has_amx():
            # llama.cpp's AMX buffer type computes in 16-row tiles: with batches cut on other
            # rows a resumed turn's KV differed from a full prefill's (measured on the tiny
            # Gemma 3 with a window checkpoint loaded at 298 and 79 tokens decoded; exact
            # with cuts on multiples of 16).
            self.batch_align = max(self.batch_align, AMX_ROWS)

    def kv_spec(self) -> KvSpec | None:
        """What the seq state must hold per layer (for the chunk parser), or None."""
        return self._spec

    def chunk_problem(self) -> str | None:
        """Why this model's state is always stored whole, or None when it can be chunked."""
        return self._spec_problem

    @property
    def interleaved(self) -> bool:
        """Whether the cache has sliding-window layers (llama.cpp's interleaved cache)."""
        return self._spec is not None and self._spec.interleaved

    # --- tokens ---------------------------------------------------------------------------

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        return self._vocab_text(token)

    def _vocab_text(self, token: int) -> str:
        text = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template over ``messages``, ending with the assistant's turn opening."""
        try:
            # llama_cpp types the formatter's keywords as OpenAI's; templates take any.
            formatter: Any = self._formatter
            options = self.template_options
            if options.get("tools"):  # a tool server's text: never a control token
                options = {**options, "tools": self._chat.safe_tools(options["tools"])}
            return str(formatter(messages=list(messages), **options).prompt)
        except Exception as exc:  # jinja2's errors, and the template's raise_exception
            raise KvchatError(f"the model's chat template refused these messages: {exc}") from exc

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text: a control token's spelling inside it stays plain characters."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def _bos_before(self, text: str) -> int | None:
        """The BOS id a prompt rendered as ``text`` starts with (None: the vocabulary adds
        none, or the template wrote it already)."""
        bos = int(self.llm.token_bos())
        if bos < 0 or not llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return None
        return None if text.startswith(self._piece(bos)) else bos

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages`` (see :meth:`ChatTokens.chat_tokens`): only the
        template's own markup makes control tokens."""
        return self._chat.chat_tokens(messages)

    def count_tokens(self, text: str) -> int:
        return len(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    @property
    def tokens(self) -> list[int]:
        """The exact token ids whose KV is in the context, in order."""
        return [int(t) for t in self.llm.input_ids[: self.llm.n_tokens]]

    @property
    def n_tokens(self) -> int:
        return int(self.llm.n_tokens)

    # --- context --------------------------------------------------------------------------

    def clear(self) -> None:
        """Empty the context (the KV of every sequence, and the token list)."""
        self._state.clear()

    # --- where the context can be cut --------------------------------------------------------

    def reuse_point(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        """Where :meth:`prefill` starts decoding ``prompt`` over a context holding ``held``.

        The common prefix, less enough that at least :data:`MIN_BATCH` tokens are decoded
        (a one-token batch computes other KV than a full prefill), rounded down to
        :attr:`batch_align` (repacked weights: see :data:`REPACKED_TYPES`).
        """
        reused = common_prefix(held, prompt)
        reused = max(0, min(reused, len(prompt) - MIN_BATCH))
        return reused - reused % self.batch_align

    def restore_floor(self, n_tokens: int) -> int:
        """The lowest position a context restored with ``n_tokens`` tokens can be cut to.

        A sliding-window model's state keeps only the last ``n_swa`` cells of its window
        layers: the token at position p attends to positions above p - n_swa, so a cut
        below ``n_tokens - 1`` would leave the next token's window short. 0 when the state
        holds every cell (no window, or fewer tokens than the window).
        """
        if self.recurrent:
            return n_tokens  # its recurrent state is its last position's alone
        if not self.interleaved or n_tokens <= self.n_swa:
            return 0
        return n_tokens - 1

    @property
    def window_floor(self) -> int:
        """The lowest position the context can be cut to now (see :meth:`restore_floor`):
        the token there attends to the ``n_swa - 1`` before it, so its window must start at
        or above the lowest position the sliding-window cache still holds. 0 when the
        cache holds every position (swa_full, or a context shorter than the cache). A
        recurrent model's context can be cut only at its end (llama.cpp refuses a cut into a
        recurrent state, even one token back: measured on 0.3.36's Mamba 2)."""
        if self.recurrent:
            return self.n_tokens
        if not self.interleaved or not self.n_tokens:
            return 0
        low = self._state.window_low()
        if low > 0 and not self.ring_cuts_exact:
            return self.n_tokens  # a cut loads a window checkpoint or decodes from the start
        return low + self.n_swa - 1 if low > 0 else 0

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        """Bring ``prompt`` into the context, decoding only what follows the common prefix.

        Never decodes a batch of one token: llama.cpp's single-token path computes slightly
        different KV than its batched path, and the batched bytes are what a full prefill
        produces. So a one-token suffix (e.g. a regenerate, which must decode the last
        prompt token again for its logits) backs off one more token; see
        :meth:`reuse_point`. A context whose sliding window cannot be cut back that far
        is decoded from the start. A sliding-window model keeps a window checkpoint where
        a regenerate of this prompt would start (see :meth:`take_checkpoints`); a recurrent
        one also where its reply starts (settle re-decodes the reply from there).
        """
        marks = {self.reuse_point(prompt, prompt)} if self._checkpointed else set()
        if self.recurrent:
            marks.add(len(prompt))
        return self._prefill(prompt, marks, cancel)

    @property
    def _checkpointed(self) -> bool:
        """Whether checkpoints are taken where conversations branch (windows, recurrent)."""
        return self.interleaved or self.recurrent

    def _prefill(
        self, prompt: Sequence[int], marks: set[int], cancel: CancelCheck | None = None
    ) -> PrefillResult:
        if len(prompt) >= self.n_ctx:
            raise KvchatError(f"the prompt ({len(prompt)} tokens) does not fit n_ctx={self.n_ctx}")
        reused = self.reuse_point(self.tokens, prompt)
        floor = self.window_floor
        if reused < floor:
            # Not aligned then (a whole state restored off a multiple of four: its last
            # tokens' KV may differ from a full prefill's by rounding), else at a window
            # checkpoint held in RAM, else from the start: the window lacks cells the next
            # token attends to.
            deepest = max(0, min(common_prefix(self.tokens, prompt), len(prompt) - MIN_BATCH))
            if deepest >= floor:
                reused = deepest
            else:
                held = self.held_checkpoint(reused)
                reused = held if held and self._state.load_window(held) else 0
        self.truncate(reused)
        reused = self.n_tokens  # 0 if llama.cpp refused the cut (the context is empty)
        if reused in marks:
            self._state.capture()
        # Tokens decoded before but not yet counted (a decode whose logits nobody read) are
        # counted at the next synchronize: flushed now, so the count is this prefill's alone.
        llama_cpp.llama_synchronize(self.ctx)
        llama_cpp.llama_perf_context_reset(self.ctx)
        for start, end in _cuts(reused, len(prompt), marks, self.prefill_slice):
            if cancel is not None and cancel():
                break
            self.llm.eval(list(prompt[start:end]))
            if end in marks:
                self._state.capture()
        decoded = self._evaluated(fallback=self.n_tokens - reused)
        return PrefillResult(prompt=len(prompt), reused=reused, decoded=decoded)

    def _evaluated(self, fallback: int) -> int:
        """Prompt tokens llama.cpp itself evaluated since its counters were reset (its perf
        counters: a resume's "decoded N" is llama.cpp's word, not a subtraction). They read
        at least 1, so 0 or 1 token is ``fallback`` (prefill decodes 2 or more, or none)."""
        llama_cpp.llama_synchronize(self.ctx)
        counted = int(llama_cpp.llama_perf_context(self.ctx).n_p_eval)
        return counted if counted > 1 else fallback

    def settle(self, keep: int, tokens: Sequence[int], cancel: CancelCheck | None = None) -> int:
        """Re-decode everything after position ``keep`` as batches, ending with ``tokens``.

        Generation decodes one token at a time; re-decoding the reply in batches makes the
        context's KV bit-identical to a full prefill of the same tokens, so a greedy
        continuation after a restore equals one after a full prefill. A sliding-window
        model keeps a window checkpoint where the next turn's prefill will start. Returns
        tokens decoded. ``cancel`` stops it between batches (a new message waits): the
        context then holds a prefix of ``tokens``, which the next prefill reuses. Below
        the context's floor without a checkpoint at or before ``keep`` the reply stays as
        generated (re-decoding everything before it would cost a full prefill).
        """
        keep = min(keep, self.n_tokens)
        if keep < self.window_floor and not self.held_checkpoint(keep):
            keep = self.n_tokens
        elif keep < self.window_floor:
            self._state.load_window(self.held_checkpoint(keep))
            keep = self.n_tokens
        self.truncate(keep)
        marks = {self.reuse_point(tokens, [*tokens, 0, 0])} if self._checkpointed else set()
        return self._prefill(tokens, marks, cancel).decoded

    def truncate(self, n_keep: int) -> None:
        """Drop the KV of every token from position ``n_keep`` on. A cut llama.cpp refuses
        (into a recurrent state) empties the context instead: never a state that holds
        tokens the token list does not."""
        mem = llama_cpp.llama_get_memory(self.ctx)
        if (self.recurrent and 0 < n_keep < self.n_tokens) or not llama_cpp.llama_memory_seq_rm(
            mem, SEQ_ID, n_keep, -1
        ):
            self.clear()
            return
        self.llm.n_tokens = n_keep
        self._state.forget_checkpoints(above=n_keep)

    def can_shift(self) -> bool:
        """Whether the KV cache can move positions (RoPE re-rotation); some models can't."""
        if self.recurrent:
            return False  # positions can't be taken out of a recurrent state
        can = getattr(llama_cpp, "llama_memory_can_shift", None)
        return True if can is None else bool(can(llama_cpp.llama_get_memory(self.ctx)))

    def shift(self, start: int, end: int) -> int:
        """Drop tokens ``[start, end)`` from the context and move the later ones down.

        llama.cpp's own context shift: remove the cells, then add ``-(end - start)`` to the
        positions after them (their K is re-rotated for RoPE). The token list is updated to
        match. Then the cells are compacted so that cell i holds token i again (see
        :meth:`_compact`). Returns the number of tokens dropped, or 0 when the compaction
        failed and the context was emptied.
        """
        tokens = self.tokens
        if not 0 <= start < end < len(tokens):
            raise ValueError(f"cannot shift out [{start}, {end}) of {len(tokens)} tokens")
        if not self.can_shift():
            raise KvchatError("this model's KV cache cannot be shifted")
        mem = llama_cpp.llama_get_memory(self.ctx)
        n_discard = end - start
        if not llama_cpp.llama_memory_seq_rm(mem, SEQ_ID, start, end):
            raise KvchatError(f"llama.cpp could not remove KV positions [{start}, {end})")
        llama_cpp.llama_memory_seq_add(mem, SEQ_ID, end, -1, -n_discard)
        kept = tokens[:start] + tokens[end:]
        self.llm.input_ids[: len(kept)] = kept
        self.llm.n_tokens = len(kept)
        return n_discard if self._compact() else 0

    def _compact(self) -> bool:
        """Apply a pending shift and put the cells back in position order.

        llama.cpp re-rotates shifted K only at the next decode, and its state bytes carry
        no pending shift, so a throwaway batch is decoded (and removed) first. Then the
        new tokens would fill the hole the shift left, and the cells would no longer be in
        position order (a state parser cutting by token ranges wants them in order): a
        seq-state round trip writes the cells out in order and reads them back packed.
        """
        n = self.n_tokens
        self.llm.eval([self.llm.input_ids[n - 1]] * MIN_BATCH)
        self.truncate(n)
        tokens = self.tokens
        size = self.state_size()
        buf = self.state_buffer(size)
        if llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, SEQ_ID) != size:
            self.clear()
            return False
        return self.state_set(buf, size, tokens)

    def generate(
        self,
        params: GenerationParams,
        stats: GenerationStats,
        cancel: CancelCheck | None = None,
    ) -> Iterator[str]:
        """Sample and stream text pieces until end of turn, ``max_tokens``, a full context or cancel.

        Every sampled token except the closing end-of-generation one is decoded into the
        context, so afterwards the context holds prompt + reply.
        """
        sampler = self._sampler(params)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generation_started = time.perf_counter()
        try:
            while True:
                if cancel is not None and cancel():
                    stats.finish_reason = "cancelled"
                    break
                if stats.generated >= params.max_tokens:
                    stats.finish_reason = "length"
                    break
                token = sampler.sample(self.llm._ctx, -1)
                if stats.ttft_ms is None:
                    stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    stats.finish_reason = "stop"
                    break
                stats.generated += 1
                piece = decoder.decode(self._token_bytes(token))
                if self.n_tokens + 1 >= self.n_ctx:
                    stats.finish_reason = "context"
                    if piece:
                        yield piece
                    break
                self.llm.eval([token])
                if piece:
                    yield piece
            # Bytes still held are the start of a character the last token cut (max_tokens,
            # a full context, cancel): dropped, never flushed as U+FFFD into the reply.
        finally:
            elapsed = time.perf_counter() - generation_started
            if stats.generated and elapsed > 0:
                stats.tokens_per_s = stats.generated / elapsed
            sampler.close()
        self._watch_speed(stats)

    def _watch_speed(self, stats: GenerationStats) -> None:
        """After a reply far slower than the probe measured for these thread counts (other
        programs took the CPU), measure the counts again and switch to the fastest."""
        from kvchat.engine.probe import COLLAPSE_MIN_TOKENS, COLLAPSE_RATIO, fastest

        measured = {n: gen for n, _, gen in self.config.thread_speeds}
        expected = measured.get(self.config.n_threads)
        if (
            not expected
            or stats.generated < COLLAPSE_MIN_TOKENS
            or not stats.tokens_per_s
            or stats.tokens_per_s >= COLLAPSE_RATIO * expected
            or time.monotonic() - self._rechecked_at < RECHECK_EVERY_S
        ):
            return
        self._rechecked_at = time.monotonic()
        speeds = self.measure_threads(sorted(measured, reverse=True))
        gen, batch = fastest(speeds, "generate"), fastest(speeds, "prefill")
        if gen is None or batch is None:
            return
        self.config = replace(
            self.config,
            n_threads=gen,
            n_threads_batch=batch,
            thread_speeds=tuple(
                (int(n), row["prefill"], row["generate"]) for n, row in speeds.items()
            ),
        )
        self.set_threads(gen, batch)
        self.slowdowns += 1

    def _token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def _sampler(self, params: GenerationParams) -> Any:
        """llama_cpp's sampler chain (its class is untyped: handled as Any)."""
        sampler = _NEW_SAMPLER()
        if params.grammar is not None:  # first: the others pick among what it allows
            try:
                grammar = LlamaGrammar.from_string(params.grammar, verbose=False)
            except ValueError as exc:
                sampler.close()
                raise KvchatError(f"the grammar cannot be read: {exc}") from None
            sampler.add_grammar(self.llm._model, grammar)
        if params.temperature <= 0:
            sampler.add_greedy()
        else:
            sampler.add_top_k(params.top_k)
            sampler.add_top_p(params.top_p, 1)
            sampler.add_min_p(params.min_p, 1)
            sampler.add_temp(params.temperature)
            sampler.add_dist(params.seed & 0xFFFFFFFF)
        return sampler

    def measure_threads(
        self, counts: Sequence[int], prompt: int = 32, generate: int = 8
    ) -> dict[str, dict[str, float]]:
        """Prefill and generation tokens/s for each thread count in ``counts``.

        Decoded in the scratch sequence (a ``prompt``-token batch, then ``generate`` single
        tokens) and removed again: the conversation's KV and tokens are untouched. {} when
        the context has no scratch sequence or too few free cells. The thread counts in use
        before are restored.
        """
        if not self.appends_state or self.n_ctx - self.n_tokens < prompt + generate + 1:
            return {}
        token = self._scratch_token()
        mem = llama_cpp.llama_get_memory(self.ctx)
        batch = llama_cpp.llama_batch_init(prompt, 0, 1)
        speeds: dict[str, dict[str, float]] = {}
        try:
            for count in counts:
                llama_cpp.llama_set_n_threads(self.ctx, count, count)
                started = time.perf_counter()
                if not self._scratch_decode(batch, [token] * prompt, 0):
                    return {}
                batch_s = time.perf_counter() - started
                started = time.perf_counter()
                for pos in range(prompt, prompt + generate):
                    if not self._scratch_decode(batch, [token], pos):
                        return {}
                step_s = time.perf_counter() - started
                llama_cpp.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
                speeds[str(count)] = {
                    "prefill": round(prompt / batch_s, 2),
                    "generate": round(generate / step_s, 2),
                }
        finally:
            llama_cpp.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
            llama_cpp.llama_batch_free(batch)
            self.set_threads(self.config.n_threads, self.config.n_threads_batch)
        return speeds

    def generate_aside(self, prompt: Sequence[int], max_tokens: int) -> str | None:
        """A greedy reply to ``prompt`` decoded in the scratch sequence and removed again:
        the conversation's KV and tokens are untouched (a title for the session, say). None
        when the context has no scratch sequence or too few free cells for it."""
        need = len(prompt) + max_tokens + 1
        if not prompt or not self.appends_state or self.n_ctx - self.n_tokens < need:
            return None
        mem = llama_cpp.llama_get_memory(self.ctx)
        batch = llama_cpp.llama_batch_init(max(len(prompt), 1), 0, 1)
        sampler = self._sampler(GenerationParams(temperature=0))
        out = bytearray()
        try:
            for start in range(0, len(prompt), self.config.n_batch):
                piece = list(prompt[start : start + self.config.n_batch])
                if not self._scratch_decode(batch, piece, start):
                    return None
            pos = len(prompt)
            for _ in range(max_tokens):
                token = sampler.sample(self.llm._ctx, -1)
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    break
                out += self._token_bytes(token)
                if not self._scratch_decode(batch, [token], pos):
                    break
                pos += 1
        finally:
            sampler.close()
            llama_cpp.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
            llama_cpp.llama_batch_free(batch)
        return out.decode("utf-8", errors="ignore")

    def _scratch_token(self) -> int:
        """An ordinary token to decode for timing (the first of a plain word)."""
        tokens = self.tokenize(" the")
        return tokens[0] if tokens else 0

    def _scratch_decode(self, batch: Any, tokens: Sequence[int], start: int) -> bool:
        """Decode ``tokens`` at positions ``start``… in the scratch sequence, logits for the
        last only."""
        count = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = SCRATCH_SEQ
            batch.logits[i] = i == count - 1
        batch.n_tokens = count
        return int(llama_cpp.llama_decode(self.ctx, batch)) == 0

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        """Use ``n_threads`` for generation and ``n_threads_batch`` (default: the same) for
        prompt batches from the next decode on."""
        llama_cpp.llama_set_n_threads(self.ctx, n_threads, n_threads_batch or n_threads)

    # --- sequence state and window checkpoints (held by ContextState) --------------------

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        return self._state.take_checkpoints()

    def held_checkpoint(self, limit: int) -> int:
        return self._state.held_checkpoint(limit)

    @property
    def appends_state(self) -> bool:
        return self._state.appends_state

    def state_size(self) -> int:
        return self._state.state_size()

    def state_buffer(self, size: int) -> ctypes.Array[ctypes.c_uint8]:
        return self._state.state_buffer(size)

    def state_get(self) -> memoryview:
        return self._state.state_get()

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        return self._state.state_set(buf, size, tokens)

    def state_append(self, buf: Any, size: int, below: int) -> bool:
        return self._state.state_append(buf, size, below)

    def state_adopt(self, tokens: Sequence[int]) -> bool:
        return self._state.state_adopt(tokens)

    def state_save_file(self, path: Path) -> int:
        return self._state.state_save_file(path)

    def state_load_file(self, path: Path) -> int:
        return self._state.state_load_file(path)

    # --- roles (see kvchat.engine.api.Engine) ------------------------------------------------

    def token_level(self) -> TokenEngine:
        return self

    def seq_state(self) -> SeqStateEngine:
        return self

    def server_slots(self) -> None:
        return None

    def remote_chat(self) -> None:
        return None

    def close(self) -> None:
        self.llm.close()


def _scratch_wanted(config: EngineConfig) -> bool:
    """Whether the context gets the scratch sequence: not for a sliding-window model with
    window-sized caches, whose state is never loaded piece by piece (see
    ``appends_state``): a second sequence would double the window cells llama.cpp keeps."""
    if config.swa_full:
        return True
    from kvchat.planner.gguf_info import read_gguf

    try:
        info = read_gguf(config.model_path)
    except KvchatError:
        return True  # llama.cpp says what is wrong with the file
    return not (info.sliding_window and any(info.swa_layers))


@contextmanager
def weight_repack(enabled: bool) -> Iterator[None]:
    """Models loaded inside this block get llama.cpp's weight repacking on or off.

    ``llama_cpp.Llama`` takes no such argument: its model parameters come from
    ``llama_model_default_params``, whose ``use_extra_bufts`` is patched for the block (off:
    the weights stay in the file's layout, no AMX or other repacked kernels).
    """
    module = llama_cpp.llama_cpp
    with PARAMS_LOCK:
        defaults = module.llama_model_default_params

        def with_choice() -> Any:
            params = defaults()
            params.use_extra_bufts = enabled
            return params

        module.llama_model_default_params = with_choice
        try:
            yield
        finally:
            module.llama_model_default_params = defaults


def _has_amx() -> bool:
    from kvchat.engine.probe import has_amx

    return has_amx()


def _cuts(start: int, end: int, marks: set[int], size: int) -> list[tuple[int, int]]:
    """The batches decoding positions [start, end): slices of ``size`` from ``start``, also
    cut at ``marks``; a lone last token joins the batch before it (never a batch of one,
    unless only one token is decoded). With ``start``, ``marks`` and ``size`` multiples of
    four, every batch but the last starts and ends on a multiple of four (see
    :data:`REPACKED_TYPES`)."""
    points = sorted({m for m in marks if start < m < end} | set(range(start + size, end, size)))
    batches: list[tuple[int, int]] = []
    at = start
    for point in [*points, end]:
        if point <= at or (point < end and end - point == 1):
            continue
        batches.append((at, point))
        at = point
    return batches
