""" "decoded N" is what llama.cpp evaluated, not a subtraction.

The engine reads llama.cpp's own perf counters after a prefill; these tests count the
tokens of every llama_decode call on their own and compare, for a fresh prefill, a resume
over a held prefix, and a turn of the service after a restore from disk.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import llama_cpp._internals as internals
import pytest

from kvchat.config import load_settings
from kvchat.engine.api import EngineConfig, GenerationParams, GenerationStats
from kvchat.paths import bundled_model_path
from kvchat.service.chat import ChatService


@pytest.fixture
def decoded_by_llama(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every llama_decode call from here on (prompt batches and single
    generated tokens alike)."""
    counts: list[int] = []
    real = internals.llama_cpp.llama_decode

    def counting(ctx, batch):  # noqa: ANN001 - ctypes values
        counts.append(int(batch.n_tokens))
        return real(ctx, batch)

    monkeypatch.setattr(internals.llama_cpp, "llama_decode", counting)
    return counts


def test_prefill_reports_what_llama_decode_was_given(decoded_by_llama: list[int]) -> None:
    from kvchat.engine.llama import LlamaEngine

    engine = LlamaEngine(EngineConfig(bundled_model_path(), n_ctx=1024, n_threads=1))
    try:
        text = "The history of Rome spans many centuries, from a village to an empire. " * 12
        tokens = engine.tokenize(text)
        first = engine.prefill(tokens[:100])
        assert (first.reused, first.decoded) == (0, 100)
        assert sum(decoded_by_llama) == 100
        decoded_by_llama.clear()
        resumed = engine.prefill(tokens[:130])
        assert resumed.reused == 100 and resumed.decoded == 30 == sum(decoded_by_llama)
        assert int(llama_cpp.llama_perf_context(engine.ctx).n_p_eval) == 30
        # A reply cut at max_tokens ends on a decode whose logits nobody reads: llama.cpp
        # counts it at its next synchronize, which must not land in the next prefill's count.
        stats = GenerationStats()
        "".join(engine.generate(GenerationParams(temperature=0, max_tokens=3), stats))
        assert stats.finish_reason == "length"
        decoded_by_llama.clear()
        follow = engine.prefill(engine.tokens + tokens[130:150])
        assert follow.decoded == sum(decoded_by_llama) == 20
    finally:
        engine.close()


def test_a_resumed_turn_decodes_only_what_llama_cpp_counted(
    kvhome: Path, decoded_by_llama: list[int]
) -> None:
    settings = load_settings(n_ctx=1024, temperature=0.0, max_tokens=12, n_threads=1)
    writer = ChatService(settings, home=kvhome)
    session = writer.start("Say hello.").session_id
    writer.close()
    service = ChatService(settings, home=kvhome)
    try:
        service.load_engine()
        decoded_by_llama.clear()
        turn = service.send(session, "And goodbye?")
        assert turn.restore.source == "disk"
        # Prompt batches: the new message alone (llama.cpp's count); single tokens: the reply.
        batches = [n for n in decoded_by_llama if n > 1]
        assert turn.tokens.decoded == batches[0] < 20
        assert turn.tokens.reused + turn.tokens.decoded == turn.tokens.prompt
    finally:
        service.close()
