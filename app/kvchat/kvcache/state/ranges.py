"""Parse, split and reassemble llama.cpp's seq-state bytes by token (cell) ranges.

The layout (llama.cpp's ``llama_kv_cache::state_write``, see DESIGN.md) carries no
version, so the parser verifies itself: every size must add up to the last byte, the
layer count must match the model, and every layer's row size must match the model's
KV width. Anything else → :class:`LayoutError`, and the caller keeps whole blobs.

Per stream the bytes are: cell metadata (pos, seq ids) for every cell; then per layer
the K rows of every cell; then V, either per layer as rows (``v_trans = 0``, flash
attention on) or transposed: per layer, per V dimension, one element of every cell.
A token range [a, b) therefore owns one contiguous run in the metadata, one per layer
in K, and one per layer (rows) or per layer × dimension (transposed) in V.

A model with sliding-window layers (Gemma 2/3: llama.cpp's interleaved cache,
``llama_kv_cache_iswa``) writes two such sections after the leading u64: the **base**
part (its full-attention layers, every cell) and then the **SWA** part (its sliding-window
layers, only the cells the window still sees: the last ``n_swa`` positions). The base part
is chunked like a unified cache; the SWA part is kept whole per position (a window
checkpoint, :func:`parse_section`) and appended when a state is reassembled.

What the parser checks against comes from the model (:class:`KvSpec`): which layers keep a
cache, each layer's K and V width (they may differ per layer), and which layers slide. A
cell's metadata is 12 bytes (pos, n_seq_id = 1, seq id), or 24 when llama.cpp stores the
cell's extra fields (M-RoPE positions, per-layer-embedding token ids): both are tried, and
only a reading where every size adds up exactly is accepted.

The code lives in three modules, re-exported here: :mod:`.state_layout` (the layout and
its stored description), :mod:`.state_parse` (parsing and cutting llama.cpp's bytes) and
:mod:`.assemble` (putting chunks back together).
"""

from kvchat.engine.api import KvSpec
from kvchat.kvcache.state.assemble import Assembler, assemble_into
from kvchat.kvcache.state.layout import (
    PREAMBLE,
    TYPE_SIZES,
    LayerData,
    LayoutError,
    StateLayout,
    base_desc,
    check_desc,
    layout_for,
    swa_spec,
)
from kvchat.kvcache.state.parse import (
    chunk_size,
    extract,
    in_position_order,
    parse,
    parse_section,
)

__all__ = [
    "PREAMBLE",
    "TYPE_SIZES",
    "Assembler",
    "KvSpec",
    "LayerData",
    "LayoutError",
    "StateLayout",
    "assemble_into",
    "base_desc",
    "check_desc",
    "chunk_size",
    "extract",
    "in_position_order",
    "layout_for",
    "parse",
    "parse_section",
    "swa_spec",
]
