"""The llama.cpp engine: load, template → tokens, prefix reuse, generation, seq-state get/set."""

from app.engine.engine import Engine, EngineConfig, GenerationParams, PrefillResult

__all__ = ["Engine", "EngineConfig", "GenerationParams", "PrefillResult"]
