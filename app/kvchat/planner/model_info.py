"""What the planner knows about a model: :class:`ModelInfo`, from a GGUF file or the catalog."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """Shape and weight layout of one model, as far as memory planning needs."""

    name: str
    architecture: str
    n_layer: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]  # per layer; 0 = the layer keeps no KV cache
    head_dim_k: int
    head_dim_v: int
    head_dim_k_swa: int
    head_dim_v_swa: int
    n_embd: int
    n_ff: int
    n_vocab: int
    context_length: int
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: True = sliding-window attention
    weight_bytes: int  # every tensor
    layer_bytes: tuple[int, ...]  # per repeating block (blk.N.*)
    input_bytes: int  # token embedding & friends: llama.cpp always keeps them in host RAM
    output_bytes: int  # output norm + output matrix (a copy of token_embd when tied)
    tied_embeddings: bool
    source: str  # "gguf" or "catalog"
    path: str | None = None
    quantization: str | None = None
    notes: tuple[str, ...] = field(default=())
    # ggml type names of the repeating layers' weights (GGUF files only).
    weight_types: tuple[str, ...] = field(default=())
    # Whether the GGUF carries a chat template (None: unknown, a catalog entry).
    has_chat_template: bool | None = None
    # The last layers reuse earlier layers' KV (Gemma 3n): they keep no cache of their own.
    shared_kv_layers: int = 0
    # Recurrent layers (Mamba, LFM2's short convolutions): per layer, True when it keeps a
    # fixed-size state per sequence; and the f32 elements of that state per layer, as
    # llama.cpp's n_embd_r (convolution) + n_embd_s (SSM). () / 0: none.
    recurrent_layers: tuple[bool, ...] = field(default=())
    recurrent_elements: int = 0
    # Whether the model writes its reasoning before the answer (None: not known, e.g. a GGUF
    # not in the catalog), and the chat-template keyword that turns it off ("": none).
    thinking: bool | None = None
    thinking_switch: str = ""

    @property
    def n_head_kv_max(self) -> int:
        return max(self.n_head_kv) if self.n_head_kv else 0

    @property
    def attention_kind(self) -> str:
        """MHA, GQA or MQA, judged from the layers that keep a KV cache."""
        pairs = [(h, kv) for h, kv in zip(self.n_head, self.n_head_kv) if kv > 0]
        if not pairs:
            return "none"
        if all(kv == h for h, kv in pairs):
            return "MHA"
        if all(kv == 1 for _, kv in pairs):
            return "MQA"
        return "GQA"

    @property
    def hybrid(self) -> bool:
        """Some layers attend (a KV cache per token), the others are recurrent."""
        return any(self.recurrent_layers) and any(self.n_head_kv)

    @property
    def recurrent_layer_bytes(self) -> int:
        """The f32 state one recurrent layer keeps for one sequence (0 without any)."""
        return 4 * self.recurrent_elements if any(self.recurrent_layers) else 0

    @property
    def recurrent_state_bytes(self) -> int:
        """llama.cpp's seq state of the recurrent layers, for one sequence: a fixed size
        whatever the context (f32 states; 28 bytes of header and cell, 24 per layer)."""
        layers = sum(self.recurrent_layers)
        if not layers:
            return 0
        return 28 + layers * (24 + 4 * self.recurrent_elements)

    def head_dims(self, layer: int) -> tuple[int, int]:
        """(K, V) head dims of ``layer``."""
        if self.swa_layers[layer]:
            return self.head_dim_k_swa, self.head_dim_v_swa
        return self.head_dim_k, self.head_dim_v

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, tuple):
                data[key] = list(value)
        data["attention_kind"] = self.attention_kind
        return data


def recurrent_elements(
    n_embd: int,
    conv_l_cache: int = 0,
    d_conv: int = 0,
    d_inner: int = 0,
    d_state: int = 0,
    n_group: int = 0,
) -> int:
    """f32 elements of one recurrent layer's state, as llama.cpp's ``n_embd_r + n_embd_s``
    count them: a short convolution (LFM2) keeps ``n_embd × (l_cache - 1)``; Mamba 2 and
    Gated DeltaNet keep their convolution window ``(d_conv - 1) × (d_inner + 2·n_group·
    d_state)`` and the SSM state ``d_state × d_inner``."""
    if conv_l_cache:
        return n_embd * (conv_l_cache - 1)
    return max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state) + d_state * d_inner


def model_marks(info: ModelInfo) -> tuple[str, ...]:
    """What sets the model apart in a list: "thinking", "hybrid" (attention and recurrent
    layers) or "recurrent" (no attention at all)."""
    marks = ["thinking"] if info.thinking else []
    if info.hybrid:
        marks.append("hybrid")
    elif any(info.recurrent_layers):
        marks.append("recurrent")
    return tuple(marks)


def swa_pattern(n_layer: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's ``set_swa_pattern(period)``: True for sliding-window layers."""
    if period == 0:
        return (True,) * n_layer
    return tuple(il % period < period - 1 for il in range(n_layer))
