"""Memory planning for GGUF models: how much conversation fits in a VRAM budget.

``gguf_info`` reads what a model looks like (from a GGUF file or the catalog);
``plan`` turns that into KV bytes per token and the largest context that fits.
"""

from __future__ import annotations

from kvchat.planner.gguf_info import (
    CatalogEntry,
    ModelInfo,
    find_entry,
    info_from_catalog,
    load_catalog,
    read_gguf,
)
from kvchat.planner.plan import (
    KvPerToken,
    Plan,
    PlanConfig,
    kv_bytes_per_token,
    make_plan,
    max_context,
    memory_at,
    parse_size,
)

__all__ = [
    "CatalogEntry",
    "KvPerToken",
    "ModelInfo",
    "Plan",
    "PlanConfig",
    "find_entry",
    "info_from_catalog",
    "kv_bytes_per_token",
    "load_catalog",
    "make_plan",
    "max_context",
    "memory_at",
    "parse_size",
    "read_gguf",
]
