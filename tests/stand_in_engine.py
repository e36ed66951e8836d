"""What a test's stand-in engine does not care about: the answers of an engine with no sliding
window, no batch alignment and no scratch sequence, and its roles (itself, token-level and
seq-state, as its ``capabilities`` say). Tests subclass it; kvchat's engines hold their parts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvchat.engine import KvSpec, WholeContext


class EngineDefaults(WholeContext):
    """A stand-in engine's defaults (see the module)."""

    batch_align: int = 1
    template_options: dict[str, object] = {}  # replaced whole, never changed in place

    @property
    def metadata(self) -> dict[str, str]:
        return {}

    def kv_spec(self) -> KvSpec | None:
        return None

    def chunk_problem(self) -> str | None:
        return None

    def generate_aside(self, prompt: Sequence[int], max_tokens: int) -> str | None:
        return None

    def measure_threads(
        self, counts: Sequence[int], prompt: int = 32, generate: int = 8
    ) -> dict[str, dict[str, float]]:
        return {}

    def token_level(self) -> Any:
        return self

    def seq_state(self) -> Any:
        return self if self.capabilities.seq_state else None  # type: ignore[attr-defined]

    def server_slots(self) -> None:
        return None

    def remote_chat(self) -> None:
        return None
