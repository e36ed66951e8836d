"""Engines behind one protocol: the value types, the :class:`Engine` protocol and its factory.

Importing this package loads no model library: implementations (``kvchat.engine.llama``)
are imported by :func:`create_engine` when the settings choose them.
"""

from kvchat.engine.api import (
    CancelCheck,
    Engine,
    EngineCapabilities,
    EngineConfig,
    GenerationParams,
    GenerationStats,
    KvSpec,
    PrefillResult,
    RemoteChatEngine,
    SeqStateEngine,
    SlotEngine,
    TokenEngine,
    WholeContext,
    common_prefix,
)
from kvchat.engine.factory import ENGINES, create_engine, engine_config

__all__ = [
    "CancelCheck",
    "common_prefix",
    "create_engine",
    "Engine",
    "EngineCapabilities",
    "EngineConfig",
    "ENGINES",
    "engine_config",
    "GenerationParams",
    "GenerationStats",
    "KvSpec",
    "PrefillResult",
    "RemoteChatEngine",
    "SeqStateEngine",
    "SlotEngine",
    "TokenEngine",
    "WholeContext",
]
