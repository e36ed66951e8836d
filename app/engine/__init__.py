"""The llama.cpp engine: load, template → tokens, prefix reuse, generation, seq-state get/set."""

from kvchat.engine.engine import Engine, EngineConfig, GenerationParams, PrefillResult, common_prefix

__all__ = ["common_prefix", "Engine", "EngineConfig", "GenerationParams", "PrefillResult"]
