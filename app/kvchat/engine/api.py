"""The engine seam: what the conversation service needs from a model, whoever runs it.

An engine holds one conversation's context: the exact token ids in it, prefix reuse,
generation, and (when it can) the raw sequence-state bytes kvcache snapshots. The
service asks :attr:`Engine.capabilities` what an engine can do, never its type. Nothing
here imports llama.cpp, so the value types can be used without loading a model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

CancelCheck = Callable[[], bool]


@dataclass(frozen=True)
class EngineConfig:
    """What it takes to open a context; every field that changes KV layout is here."""

    model_path: Path
    n_ctx: int = 8192
    n_batch: int = 512
    n_threads: int = 2
    # Threads for prompt batches (prefill); None: the same as n_threads.
    n_threads_batch: int | None = None
    n_gpu_layers: int = -1
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    # Sliding-window layers keep every cell (llama.cpp's swa_full) instead of a window's
    # worth: ~5× the KV on Gemma 3, for nothing kvchat needs (window checkpoints cut back).
    swa_full: bool = False
    seed: int = 0
    # A built-in template name or a Jinja file (kvchat.planner.templates); None: the GGUF's.
    chat_template: str | None = None
    # llama.cpp's weight repacking (its CPU "extra buffer types": AMX, AVX-512 and ARM
    # layouts). None: what the engine probe found safe on this machine (kvchat.engine.probe).
    repack: bool | None = None
    # Tokens/s the probe measured per thread count, as (threads, prefill, generate), when
    # the thread counts are the probe's choice: a turn far slower makes the engine measure
    # again and switch (LlamaEngine.generate). Empty: the counts were set, nothing is watched.
    thread_speeds: tuple[tuple[int, float, float], ...] = ()


@dataclass(frozen=True)
class KvSpec:
    """The KV cache a model keeps, as its seq state must show it.

    One entry per layer that keeps a cache, in layer order: the K width and V width in
    elements (``n_head_kv × head_dim``; V 0 when the layer keeps no V) and whether the
    layer uses the sliding window. ``n_swa`` is the window in tokens (0: none).
    """

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]
    swa: tuple[bool, ...] = ()
    n_swa: int = 0

    @classmethod
    def uniform(cls, n_layer: int, k_width: int, v_width: int) -> KvSpec:
        return cls((k_width,) * n_layer, (v_width,) * n_layer, (False,) * n_layer)

    @property
    def n_layer(self) -> int:
        return len(self.k_widths)

    @property
    def interleaved(self) -> bool:
        """Whether llama.cpp keeps two caches (full-attention layers, sliding-window layers)."""
        return self.n_swa > 0 and any(self.swa)

    def part(self, swa: bool) -> tuple[list[int], list[int]]:
        """(K widths, V widths) of the base (``swa`` False) or sliding-window layers."""
        pick = [i for i in range(self.n_layer) if bool(self.swa and self.swa[i]) == swa]
        if not self.interleaved:
            pick = [] if swa else list(range(self.n_layer))
        return [self.k_widths[i] for i in pick], [self.v_widths[i] for i in pick]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond prefill and generate; the service branches on these."""

    # Sequence state as raw bytes (state_get/state_set): snapshots in the RAM and disk tiers.
    seq_state: bool = False
    # Drop a block of positions and move the later ones down (a KV shift), vs re-reading.
    can_shift: bool = False
    # Layers can run on a GPU.
    gpu_offload: bool = False
    # The KV lives in a llama-server's slots, saved and restored as slot files on the server
    # (kvchat.kvcache.server_tiers) instead of the RAM and disk tiers.
    server_slots: bool = False
    # A state can be loaded one piece (a run of cells) at a time: state_append/state_adopt.
    appends_state: bool = False
    # Sliding-window layers keep only a window of cells: the context can be cut no lower
    # than ``window_floor``, and ``take_checkpoints`` hands over the window's cells where
    # branches start (kvchat.kvcache.cold.checkpoints).
    window_checkpoints: bool = False
    # The engine takes whole messages, not token ids (an OpenAI-compatible server): its
    # server applies the template, tokenizes and keeps the KV. The service sends the message
    # list, reports the server's own figures and keeps no tiers (no snapshots: not its KV).
    remote_chat: bool = False


@dataclass(frozen=True)
class GenerationParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    max_tokens: int = 512
    seed: int = 0
    # A GBNF grammar the reply must follow (llama.cpp's grammar sampler; None: free text).
    grammar: str | None = None


@dataclass
class PrefillResult:
    """How a prompt was brought into the context."""

    prompt: int
    reused: int
    decoded: int


@dataclass
class GenerationStats:
    """Filled in while :meth:`Engine.generate` streams."""

    generated: int = 0
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str = "stop"
    # When the user's turn began: TTFT counts restore and prefill too.
    started: float = field(default_factory=time.perf_counter)


class Engine(Protocol):
    """What every engine is (a loaded model, whoever runs it): the core the service holds.

    Anything more is a role the engine has or has not, handed out by the accessors below
    as its :attr:`capabilities` say (``None``: not this engine's): token-level prefill and
    generation (:class:`TokenEngine`), raw sequence-state bytes (:class:`SeqStateEngine`),
    a llama-server's slots (:class:`SlotEngine`), whole-message chat
    (:class:`RemoteChatEngine`). The service asks for a role, never for a type.
    """

    config: EngineConfig
    n_ctx: int

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def model_name(self) -> str: ...

    def layout(self) -> dict[str, Any]:
        """Settings that decide the KV bytes' meaning (type_k/v, flash_attn, RoPE, SWA, n_layer)."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as message text (no template markup); 0, the store's "not
        counted", where the tokenizer is not kvchat's to run (a remote server's)."""
        ...

    def close(self) -> None: ...

    def token_level(self) -> TokenEngine | None:
        """This engine as token ids in and out (kvchat renders and tokenizes), or None."""
        ...

    def seq_state(self) -> SeqStateEngine | None:
        """This engine's KV as raw bytes (``capabilities.seq_state``), or None."""
        ...

    def server_slots(self) -> SlotEngine | None:
        """This engine's KV in a llama-server's slots (``capabilities.server_slots``), or None."""
        ...

    def remote_chat(self) -> RemoteChatEngine | None:
        """This engine taking whole messages (``capabilities.remote_chat``), or None."""
        ...


class TokenEngine(Engine, Protocol):
    """The token-level role: kvchat renders the template, tokenizes, and the engine holds one
    context (sequence 0) whose exact token ids it knows. Not thread-safe."""

    # --- identity of the KV bytes (for the snapshot fingerprint and chunk parser) ----------

    def kv_shape(self) -> tuple[int, int, int] | None:
        """(layers, K width, V width) per token and layer, or None when not uniform."""
        ...

    # --- where the context can be cut (WholeContext answers for an engine without
    # sliding windows or batch alignment) ------------------------------------------------

    # Prefill starts at a multiple of this many tokens (repacked weights decode in tiles).
    batch_align: int
    # The model file's GGUF metadata ({} where the engine does not read the file).
    metadata: dict[str, str]
    # Keyword arguments the chat template is rendered with (``enable_thinking``, ...);
    # an engine whose template is not kvchat's to render (a llama-server's) ignores them.
    template_options: dict[str, object]

    def kv_spec(self) -> KvSpec | None:
        """Per-layer KV widths and sliding-window layers (for the chunk parser), or None."""
        ...

    def chunk_problem(self) -> str | None:
        """Why this model's state is always stored whole, or None when it can be chunked."""
        ...

    def reuse_point(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        """Where :meth:`prefill` starts decoding ``prompt`` over a context holding ``held``."""
        ...

    def restore_floor(self, n_tokens: int) -> int:
        """The lowest cut of a context restored with ``n_tokens`` tokens (0: any)."""
        ...

    @property
    def window_floor(self) -> int:
        """The lowest position the context can be cut to now (0: any)."""
        ...

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        """Window checkpoints (position, partial state) taken since the last call
        (``capabilities.window_checkpoints``; [] otherwise)."""
        ...

    def held_checkpoint(self, limit: int) -> int:
        """The furthest position, at most ``limit``, where the context can be cut below its
        :attr:`window_floor` with a window checkpoint the engine still holds in RAM (its
        prefill then loads that window there); 0 when it holds none."""
        ...

    # --- tokens ---------------------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template over ``messages``, ending with the assistant's turn opening."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text (no BOS): the spelling of a control token stays characters."""
        ...

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``. Only the template's own markup may become control
        tokens: every message's content is tokenized as text, so a pasted ``<|im_end|>``
        can never end a turn or forge one. Deterministic (prefix reuse compares ids)."""
        ...

    @property
    def tokens(self) -> list[int]:
        """The exact token ids whose KV is in the context, in order."""
        ...

    @property
    def n_tokens(self) -> int: ...

    # --- context --------------------------------------------------------------------------

    def clear(self) -> None: ...

    def prefill(self, prompt: Sequence[int], cancel: CancelCheck | None = None) -> PrefillResult:
        """Bring ``prompt`` into the context, decoding only what follows the common prefix."""
        ...

    def settle(self, keep: int, tokens: Sequence[int], cancel: CancelCheck | None = None) -> int:
        """Re-decode everything after position ``keep`` so the context holds ``tokens``
        (``cancel`` stops between batches: the context then holds a prefix of them)."""
        ...

    def generate(
        self, params: GenerationParams, stats: GenerationStats, cancel: CancelCheck | None = None
    ) -> Iterator[str]:
        """Sample and stream text pieces; afterwards the context holds prompt + reply."""
        ...

    def generate_aside(self, prompt: Sequence[int], max_tokens: int) -> str | None:
        """A greedy reply to ``prompt`` made beside the conversation (its KV and tokens
        untouched); None where the engine cannot."""
        ...

    def measure_threads(
        self, counts: Sequence[int], prompt: int = 32, generate: int = 8
    ) -> dict[str, dict[str, float]]:
        """Prefill and generation tokens/s per thread count, measured without touching the
        conversation's KV; {} where the engine cannot (a llama-server's threads are its own)."""
        ...


class SeqStateEngine(TokenEngine, Protocol):
    """The role of an engine whose KV is in this process (``capabilities.seq_state``): its
    context's KV moves as raw bytes (the RAM and disk tiers) and its positions can shift."""

    def shift(self, start: int, end: int) -> int:
        """Drop positions ``[start, end)`` and move the later ones down (only where
        ``capabilities.can_shift``); returns tokens dropped."""
        ...

    def state_size(self) -> int: ...

    def state_buffer(self, size: int) -> Any:
        """A reusable writable buffer of at least ``size`` bytes."""
        ...

    def state_get(self) -> memoryview: ...

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        """Load ``size`` state bytes; on success the context holds ``tokens``, else it is empty."""
        ...

    def state_append(self, buf: Any, size: int, below: int) -> bool:
        """Add a state's cells with positions below ``below`` after those the context holds
        (capabilities.appends_state); on failure the context is empty."""
        ...

    def state_adopt(self, tokens: Sequence[int]) -> bool:
        """After appending: the context holds ``tokens`` if its cells are exactly their
        positions, else it is emptied (False)."""
        ...

    def state_save_file(self, path: Path) -> int: ...

    def state_load_file(self, path: Path) -> int: ...


class SlotEngine(TokenEngine, Protocol):
    """The role of an engine whose context is a llama-server's slot
    (``capabilities.server_slots``): the slot tiers (kvchat.kvcache.server_tiers) save and
    restore it as slot files on the server."""

    n_slots: int
    # The slot that is the context now (see use_slot).
    slot: int
    # The server_slot_dir setting: where the server's slot files are readable here.
    slot_dir_setting: str | None

    @property
    def server_url(self) -> str: ...

    @property
    def exact(self) -> int:
        """How many leading tokens hold exactly the KV a full prefill of them computes."""
        ...

    def identity(self) -> dict[str, Any]:
        """What a slot file's KV depends on, as the server reports it."""
        ...

    def use_slot(self, slot: int, tokens: Sequence[int], exact: int = 0) -> None:
        """Make ``slot`` the context, holding ``tokens`` (the first ``exact`` exactly)."""
        ...

    def slot_save(self, filename: str) -> dict[str, int]: ...

    def slot_restore(self, filename: str) -> dict[str, int]: ...

    def slot_erase(self) -> None: ...

    def kv_check(
        self, tokens: Sequence[int], probe: Sequence[int] | None = None
    ) -> tuple[list[int], list[tuple[int, float]]]:
        """What the slot's KV for ``tokens`` gives: the probe tokens read after it, and the
        top log-probabilities of the next token."""
        ...


class RemoteChatEngine(Engine, Protocol):
    """The role of an engine that takes whole messages (``capabilities.remote_chat``, an
    OpenAI-compatible server): its server renders, tokenizes and keeps the KV."""

    url: str
    # The server's own figures for the last reply (kvchat.engine.openai.ServerFigures).
    figures: Any

    @property
    def note(self) -> str:
        """Where the model runs, one line for the status bar."""
        ...

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: GenerationParams,
        stats: GenerationStats,
        session_id: str,
        think: bool | None = None,
        cancel: CancelCheck | None = None,
    ) -> Iterator[tuple[str, str]]:
        """Stream the reply as ``("reasoning" | "answer", text)`` pieces."""
        ...


class WholeContext:
    """The answers, about cutting the context, of an engine whose KV has no sliding window
    and no batch alignment (a llama-server): an engine holds one and hands these on."""

    def reuse_point(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        """The common prefix, less the two tokens a prefill always decodes."""
        return max(0, min(common_prefix(held, prompt), len(prompt) - 2))

    def restore_floor(self, n_tokens: int) -> int:
        return 0

    @property
    def window_floor(self) -> int:
        return 0

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        return []

    def held_checkpoint(self, limit: int) -> int:
        return 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_spellings(
    pattern: re.Pattern[str] | None, text: str, shortest: int = 1
) -> Iterator[tuple[str, bool]]:
    """``text`` cut at the matches of ``pattern`` (special-token spellings): ``(match, True)``
    for a match of at least ``shortest`` characters, ``(text, False)`` for what lies between
    (a shorter match stays in that text)."""
    if pattern is None:
        yield text, False
        return
    at = 0
    for match in pattern.finditer(text):
        if len(match.group()) < shortest:
            continue  # left in the text before the next match
        if match.start() > at:
            yield text[at : match.start()], False
        yield match.group(), True
        at = match.end()
    if at < len(text):
        yield text[at:], False
