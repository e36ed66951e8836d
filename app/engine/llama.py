"""The local llama.cpp engine: one llama.cpp context holding one conversation (sequence 0).

The engine keeps the exact token ids that are in the context, so a new prompt reuses
the longest common prefix and only its suffix is decoded. It knows nothing of
sessions, SQLite or snapshot files: it hands out and accepts raw seq-state bytes.
Not thread-safe: the caller runs every method on one thread.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import re
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import _internals as internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from kvchat.engine.base import (
    CancelCheck,
    EngineCapabilities,
    EngineConfig,
    GenerationParams,
    GenerationStats,
    KvSpec,
    PrefillResult,
    common_prefix,
)
from kvchat.engine.templates import CHATML, ChosenTemplate, catalog_template, choose_template
from kvchat.errors import KvchatError

SEQ_ID = 0
# Prefill is decoded in slices this long so a cancel request is honoured between them.
PREFILL_SLICE = 128
# The smallest batch decoded (see LlamaEngine.prefill).
MIN_BATCH = 2

GGML_TYPES: dict[str, int] = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}

# Tokens that llama.cpp parses out of text when asked to (``special=True``).
_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
# What C's isspace() strips next to a token with the LSTRIP/RSTRIP attribute.
_C_SPACE = " \t\n\v\f\r"

# Used when a GGUF carries no chat template and nothing else chooses one (see
# kvchat.engine.templates): ChatML, which most small instruct models speak.
CHATML_TEMPLATE = CHATML

# Weight types llama.cpp's CPU backend repacks (ggml-cpu/repack.cpp). Their matrix products
# take a batch's rows four at a time and the remaining ones singly, with other rounding:
# a token's KV then depends on where in its batch it falls. Batches that start on
# multiples of four make every token but a batch's tail land where a full prefill puts it.
REPACKED_TYPES = frozenset(
    {"Q1_0", "Q2_K", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "MXFP4"}
)
REPACK_ROWS = 4
# Window checkpoints (sliding-window models) kept in memory until the next save: a turn
# takes two (where a regenerate and where the next turn start), each a whole window.
MAX_PENDING_CHECKPOINTS = 2


class LlamaEngine:
    """A loaded model and its one context (implements :class:`kvchat.engine.Engine`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.type_v != "f16" and not config.flash_attn:
            raise KvchatError(
                f"a quantized V cache (type_v={config.type_v}) needs flash attention: "
                "set flash_attn = true or keep type_v = f16"
            )
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(config.model_path),
                n_ctx=config.n_ctx,
                n_batch=config.n_batch,
                n_ubatch=config.n_batch,
                n_threads=config.n_threads,
                n_threads_batch=config.n_threads,
                n_gpu_layers=config.n_gpu_layers,
                type_k=GGML_TYPES[config.type_k],
                type_v=GGML_TYPES[config.type_v],
                flash_attn=config.flash_attn,
                # Sliding-window layers keep every cell in the context (llama.cpp's default,
                # said here because kvchat relies on it: prefix reuse cuts the context back).
                swa_full=True,
                seed=config.seed,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise KvchatError(f"could not load model {config.model_path}: {exc}") from exc
        self.ctx = self.llm._ctx.ctx
        self.n_ctx: int = llama_cpp.llama_n_ctx(self.ctx)
        self.metadata: dict[str, str] = dict(self.llm.metadata)
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
        self._state_buffer: ctypes.Array[ctypes.c_uint8] | None = None
        model = self.llm._model.model
        self.n_swa = int(llama_cpp.llama_model_n_swa(model))
        self._spec: KvSpec | None = None
        self._spec_problem: str | None = None
        self._read_spec()
        # Sliding-window models: the first position whose window KV the context really
        # holds (a restored state keeps only the window's cells), and window checkpoints
        # taken at message boundaries, by position, until the next save takes them.
        self._swa_from = 0
        self._pending: dict[int, ctypes.Array[ctypes.c_uint8]] = {}
        self._markup = _Markup(self._vocab)
        # Stands in for message i's content while the template renders: private-use
        # characters and a random part, so no message text can contain or forge one.
        self._slot_id = secrets.token_hex(8)
        self._slot = f"\ue000{self._slot_id}:"
        self._slots = re.compile(re.escape(self._slot) + r"(\d+)\ue001")

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
            seq_state=True, can_shift=self.can_shift(), gpu_offload=self.gpu_offload
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
            "n_swa": int(llama_cpp.llama_model_n_swa(model))
            if hasattr(llama_cpp, "llama_model_n_swa")
            else int(self.metadata.get(f"{arch}.attention.sliding_window", 0) or 0),
            "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        }

    def kv_shape(self) -> tuple[int, int, int] | None:
        """(layers, K width, V width) per token and layer, or None when layers differ."""
        arch = self.metadata.get("general.architecture", "")
        meta = self.metadata

        def number(key: str) -> int | None:
            value = meta.get(f"{arch}.{key}")
            try:
                return int(value) if value is not None else None
            except ValueError:  # an array (per-layer values): not a uniform shape
                return None

        n_layer = int(llama_cpp.llama_model_n_layer(self.llm._model.model))
        n_head = number("attention.head_count")
        n_head_kv = number("attention.head_count_kv") or n_head
        n_embd = number("embedding_length")
        if not (n_head and n_head_kv and n_embd):
            return None
        k_dim = number("attention.key_length") or n_embd // n_head
        v_dim = number("attention.value_length") or n_embd // n_head
        return n_layer, n_head_kv * k_dim, n_head_kv * v_dim

    def _read_spec(self) -> None:
        """What the model's KV cache holds per layer, from its GGUF metadata (the same
        reading as the memory planner's), or why its state cannot be cut into chunks."""
        model = self.llm._model.model
        self.batch_align = 1
        if llama_cpp.llama_model_is_recurrent(model):
            self._spec_problem = "a recurrent model keeps a fixed-size state, not per-token KV"
            return
        if llama_cpp.llama_model_is_hybrid(model):
            self._spec_problem = (
                "a hybrid model (attention and recurrent layers) keeps a recurrent state "
                "besides its per-token KV"
            )
            return
        from kvchat.planner.gguf_info import read_gguf

        try:
            info = read_gguf(self.config.model_path)
        except KvchatError as exc:
            self._spec_problem = f"its GGUF metadata could not be read ({exc})"
            return
        if REPACKED_TYPES.intersection(info.weight_types):
            self.batch_align = REPACK_ROWS
        k_widths: list[int] = []
        v_widths: list[int] = []
        swa: list[bool] = []
        arch = info.architecture
        shared = int(self.metadata.get(f"{arch}.attention.shared_kv_layers", 0) or 0)
        for il in range(info.n_layer):
            if il >= info.n_layer - shared:
                continue  # the layer reuses another layer's cache (Gemma 3n style)
            kv_heads = info.n_head_kv[il]  # 0: the layer keeps zero-width rows (DeciLM)
            d_k, d_v = info.head_dims(il)
            k_widths.append(kv_heads * d_k)
            v_widths.append(kv_heads * d_v)
            swa.append(info.swa_layers[il])
        n_swa = self.n_swa if any(swa) else 0
        if any(swa) and n_swa != info.sliding_window:
            self._spec_problem = (
                f"llama.cpp's sliding window ({self.n_swa}) is not the GGUF's "
                f"({info.sliding_window})"
            )
            return
        self._spec = KvSpec(tuple(k_widths), tuple(v_widths), tuple(swa), n_swa)

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
            return self._formatter(messages=list(messages)).prompt
        except Exception as exc:  # jinja2's errors, and the template's raise_exception
            raise KvchatError(f"the model's chat template refused these messages: {exc}") from exc

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text: a control token's spelling inside it stays plain characters."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def _add_bos(self, text: str) -> bool:
        bos = self.llm.token_bos()
        if bos < 0 or not llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return False
        return not text.startswith(self._piece(bos))

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``: only the template's own markup makes control tokens.

        The template is rendered with each message's content replaced by a slot marker; the
        rendering is cut at the markers, and the template's pieces are split at the spellings
        of the vocabulary's special tokens (as llama.cpp's ``special=True`` does). The text
        between two special tokens (template text and message content together, as one
        string, so the tokens are those of a plain tokenization) is tokenized with
        ``special=False``. So ``<|im_end|>`` typed, pasted, imported or in a system prompt
        is eight ordinary tokens, never the end of a turn. Deterministic: the same messages
        give the same ids, whatever the markers were.

        A template that alters or drops a message's content (so a marker is missing or
        changed) is rendered over the real messages instead, with every special token's
        spelling in them broken by a word joiner (U+2060), and tokenized whole.
        """
        contents = [str(m.get("content") or "") for m in messages]
        stand_ins = [{**m, "content": f"{self._slot}{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.render(stand_ins)
        pieces = self._slots.split(rendered)
        found = {int(index) for index in pieces[1::2]}
        if found != set(range(len(messages))) or any(self._slot_id in p for p in pieces[::2]):
            return self._defanged_tokens(messages, contents)
        tokens: list[int] = [self.llm.token_bos()] if self._add_bos(rendered) else []
        run = _TextRun()
        for index, piece in enumerate(pieces):
            if index % 2:  # a message's content
                run.add(contents[int(piece)])
                continue
            for text, special in self._markup.split(piece):
                if special is None:
                    run.add(text)
                    continue
                if special.lstrip:
                    run.strip_end()
                tokens += self.tokenize(run.take())
                tokens.append(special.id)
                run.strip_next = special.rstrip
        tokens += self.tokenize(run.take())
        return tokens

    def _defanged_tokens(
        self, messages: Sequence[dict[str, str]], contents: list[str]
    ) -> list[int]:
        """The prompt of a template that changes message text: the real messages, with no
        special token's spelling left in their content, tokenized with ``special=True``."""
        safe = [{**m, "content": self._markup.defang(c)} for m, c in zip(messages, contents)]
        rendered = self.render(safe)
        return self.llm.tokenize(
            rendered.encode("utf-8"), add_bos=self._add_bos(rendered), special=True
        )

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
        """Empty the context (the KV of sequence 0 and the token list)."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), SEQ_ID, -1, -1)
        self.llm.n_tokens = 0
        self._swa_from = 0
        self._pending.clear()

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
        if not self.interleaved or n_tokens <= self.n_swa:
            return 0
        return n_tokens - 1

    @property
    def window_floor(self) -> int:
        """The lowest position the context can be cut to now (see :meth:`restore_floor`)."""
        if not self._swa_from:
            return 0
        return self._swa_from + self.n_swa - 1

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        """Bring ``prompt`` into the context, decoding only what follows the common prefix.

        Never decodes a batch of one token: llama.cpp's single-token path computes slightly
        different KV than its batched path, and the batched bytes are what a full prefill
        produces. So a one-token suffix (e.g. a regenerate, which must decode the last
        prompt token again for its logits) backs off one more token; see
        :meth:`reuse_point`. A context whose sliding window cannot be cut back that far
        is decoded from the start. A sliding-window model keeps a window checkpoint where
        a regenerate of this prompt would start (see :meth:`take_checkpoints`).
        """
        marks = {self.reuse_point(prompt, prompt)} if self.interleaved else set()
        return self._prefill(prompt, marks, cancel)

    def _prefill(
        self, prompt: Sequence[int], marks: set[int], cancel: CancelCheck | None = None
    ) -> PrefillResult:
        if len(prompt) >= self.n_ctx:
            raise KvchatError(f"the prompt ({len(prompt)} tokens) does not fit n_ctx={self.n_ctx}")
        reused = self.reuse_point(self.tokens, prompt)
        floor = self.window_floor
        if reused < floor:
            # Not aligned then (a whole state restored off a multiple of four: its last
            # tokens' KV may differ from a full prefill's by rounding), else from the start:
            # the window lacks cells the next token attends to.
            deepest = max(0, min(common_prefix(self.tokens, prompt), len(prompt) - MIN_BATCH))
            reused = deepest if deepest >= floor else 0
        self.truncate(reused)
        if reused in marks:
            self._capture()
        for start, end in _cuts(reused, len(prompt), marks, PREFILL_SLICE):
            if cancel is not None and cancel():
                break
            self.llm.eval(list(prompt[start:end]))
            if end in marks:
                self._capture()
        return PrefillResult(prompt=len(prompt), reused=reused, decoded=self.n_tokens - reused)

    def settle(self, keep: int, tokens: Sequence[int]) -> int:
        """Re-decode everything after position ``keep`` as batches, ending with ``tokens``.

        Generation decodes one token at a time; re-decoding the reply in batches makes the
        context's KV bit-identical to a full prefill of the same tokens, so a greedy
        continuation after a restore equals one after a full prefill. A sliding-window
        model keeps a window checkpoint where the next turn's prefill will start. Returns
        tokens decoded.
        """
        self.truncate(min(keep, self.n_tokens))
        marks = {self.reuse_point(tokens, [*tokens, 0, 0])} if self.interleaved else set()
        return self._prefill(tokens, marks).decoded

    def truncate(self, n_keep: int) -> None:
        """Drop the KV of every token from position ``n_keep`` on."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), SEQ_ID, n_keep, -1)
        self.llm.n_tokens = n_keep
        if n_keep == 0:
            self._swa_from = 0
        for pos in [pos for pos in self._pending if pos > n_keep]:
            del self._pending[pos]

    # --- window checkpoints (sliding-window models) -------------------------------------

    def _capture(self) -> None:
        """Keep the window's cells at the current position (llama.cpp's partial state: the
        sliding-window cache alone), if the context really holds all of them."""
        n = self.n_tokens
        if not n or (self._swa_from and n < self._swa_from + self.n_swa) or n in self._pending:
            return
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, SEQ_ID, flags))
        buf = (ctypes.c_uint8 * size)()
        if (
            not size
            or llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, SEQ_ID, flags) != size
        ):
            return
        self._pending[n] = buf
        while len(self._pending) > MAX_PENDING_CHECKPOINTS:
            del self._pending[min(self._pending)]

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        """Window checkpoints taken since the last call, as (position, partial state) with
        the context still holding the tokens before each position; then forgotten."""
        taken = sorted((pos, data) for pos, data in self._pending.items() if pos <= self.n_tokens)
        self._pending.clear()
        return taken

    def can_shift(self) -> bool:
        """Whether the KV cache can move positions (RoPE re-rotation); some models can't."""
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

    def _token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def _sampler(self, params: GenerationParams) -> internals.LlamaSampler:
        sampler = internals.LlamaSampler()
        if params.temperature <= 0:
            sampler.add_greedy()
        else:
            sampler.add_top_k(params.top_k)
            sampler.add_top_p(params.top_p, 1)
            sampler.add_min_p(params.min_p, 1)
            sampler.add_temp(params.temperature)
            sampler.add_dist(params.seed & 0xFFFFFFFF)
        return sampler

    # --- sequence state -------------------------------------------------------------------

    def state_size(self) -> int:
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, SEQ_ID))

    def state_buffer(self, size: int) -> ctypes.Array[ctypes.c_uint8]:
        """A reusable buffer of at least ``size`` bytes (fresh allocations page-fault)."""
        if self._state_buffer is None or len(self._state_buffer) < size:
            self._state_buffer = (ctypes.c_uint8 * max(size, 1))()
        return self._state_buffer

    def state_get(self) -> memoryview:
        """The seq-state bytes of the context, as a view into the engine's reusable buffer."""
        size = self.state_size()
        buf = self.state_buffer(size)
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, SEQ_ID)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return memoryview(buf).cast("B")[:size]

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        """Load ``size`` seq-state bytes from ``buf`` (a ctypes array or uint8 pointer).

        On success the context holds ``tokens``; on failure it is empty.
        """
        self.clear()
        loaded = llama_cpp.llama_state_seq_set_data(self.ctx, buf, size, SEQ_ID)
        if loaded != size:
            self.clear()
            return False
        n = len(tokens)
        self.llm.input_ids[:n] = tokens
        self.llm.n_tokens = n
        # A state keeps only the window's cells of its sliding-window layers.
        self._swa_from = max(0, n - self.n_swa) if self.interleaved else 0
        return True

    def state_save_file(self, path: Path) -> int:
        """llama.cpp's own seq-state file writer (the benchmark's reference)."""
        tokens = (llama_cpp.llama_token * max(self.n_tokens, 1))(*self.tokens)
        return int(
            llama_cpp.llama_state_seq_save_file(
                self.ctx, os.fsencode(path), SEQ_ID, tokens, self.n_tokens
            )
        )

    def state_load_file(self, path: Path) -> int:
        """llama.cpp's own seq-state file reader (the benchmark's limit); returns bytes read."""
        self.clear()
        capacity = self.n_ctx
        tokens = (llama_cpp.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(
            self.ctx, os.fsencode(path), SEQ_ID, tokens, capacity, ctypes.byref(count)
        )
        n = int(count.value)
        self.llm.input_ids[:n] = list(tokens[:n])
        self.llm.n_tokens = n
        return int(read)

    def close(self) -> None:
        self.llm.close()


class _Special:
    """A special token: its id, and whether llama.cpp strips whitespace beside it."""

    __slots__ = ("id", "lstrip", "rstrip")

    def __init__(self, token: int, attr: int) -> None:
        self.id = token
        self.lstrip = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP)
        self.rstrip = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)


class _Markup:
    """Splits template text at the spellings of the vocabulary's special tokens.

    The same tokens llama.cpp parses with ``special=True`` (control, user-defined and
    unknown), the longest spelling first where two could match at one place.
    """

    def __init__(self, vocab: Any) -> None:
        found: dict[str, _Special] = {}
        for token in range(int(llama_cpp.llama_vocab_n_tokens(vocab))):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, token))
            if not attr & _SPECIAL_ATTRS:
                continue
            raw = llama_cpp.llama_vocab_get_text(vocab, token)
            try:
                text = raw.decode("utf-8") if raw else ""
            except UnicodeDecodeError:
                continue
            if text and text not in found:
                found[text] = _Special(token, attr)
        self.tokens = found
        spellings = sorted(found, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, spellings))) if spellings else None

    def defang(self, text: str) -> str:
        """``text`` with a word joiner after the first character of every special token's
        spelling in it, so no tokenizer can read one there."""
        if self._pattern is None:
            return text
        for _ in range(len(text) + 1):
            fixed = self._pattern.sub(_break_spelling, text)
            if fixed == text:
                break
            text = fixed
        return text

    def split(self, text: str) -> Iterator[tuple[str, _Special | None]]:
        """``(text, None)`` for plain text and ``(spelling, token)`` for a special token."""
        if self._pattern is None:
            yield text, None
            return
        at = 0
        for match in self._pattern.finditer(text):
            if match.start() > at:
                yield text[at : match.start()], None
            yield match.group(), self.tokens[match.group()]
            at = match.end()
        if at < len(text):
            yield text[at:], None


def _break_spelling(match: re.Match[str]) -> str:
    """A special token's spelling with a word joiner after its first character (a
    one-character spelling cannot be broken: it stays)."""
    text = match.group()
    return text if len(text) < 2 else text[0] + "\u2060" + text[1:]


class _TextRun:
    """The text between two special tokens, gathered to be tokenized as one string."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.strip_next = False  # the last special token strips the whitespace after it

    def add(self, text: str) -> None:
        if self.strip_next:
            text = text.lstrip(_C_SPACE)
            self.strip_next = not text
        if text:
            self.parts.append(text)

    def strip_end(self) -> None:
        text = "".join(self.parts).rstrip(_C_SPACE)
        self.parts = [text] if text else []

    def take(self) -> str:
        text = "".join(self.parts)
        self.parts = []
        return text


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
