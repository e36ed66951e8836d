"""Chunk restores with the real model: the continuation after a restore from chunks equals
the hot context's, chunks loaded one at a time rebuild the saved state byte for byte, and
a damaged chunk of a real state falls back with its reason."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from tests.unit.kvcache.test_chunk_read import (
    Spy,
    flip_last_byte,
    spy,
)

__all__ = ["spy"]  # fixtures shared with the module they come from


# --- end to end: the real model --------------------------------------------------------

SMALL_CHUNKS = dict(temperature=0, max_tokens=16, n_ctx=1024, chunk_tokens=16)


@pytest.mark.parametrize("flash_attn", [False, True], ids=["v-transposed", "v-rows"])
def test_e2e_chunk_restore_continues_like_the_hot_context(
    tmp_path: Path, flash_attn: bool, spy: Spy
) -> None:
    """The next turn after a restore from chunks equals the same turn with the session still
    in the context (both decode the new message over the same cached tokens; a full
    prefill is compared in test_tiers, with flash attention off, where llama.cpp's batched
    and cached paths agree bit for bit)."""
    settings = Settings(**SMALL_CHUNKS, flash_attn=flash_attn)
    first, second = "Name three rivers and say where each one flows.", "Which is the longest?"
    hot = ChatService(settings, home=tmp_path / "hot")
    session = hot.sessions.new_session()
    hot.send(session.id, first)
    kept = hot.send(session.id, second)
    assert kept.restore.source == "hot"
    hot.close()

    cold_home = tmp_path / "cold"
    writer = ChatService(settings, home=cold_home)
    twin = writer.sessions.new_session()
    assert writer.send(twin.id, first).snapshot.chunks_written >= 3
    writer.close()
    resumed = ChatService(settings, home=cold_home)
    restored = resumed.send(twin.id, second)
    resumed.close()
    assert restored.restore.source == "disk", restored.restore.reason
    assert restored.tokens.reused == kept.tokens.reused == restored.restore.tokens
    # One chunk at a time into llama.cpp, none through a whole state's buffer.
    assert spy.pieces == spy.direct >= 3 and spy.mapped == 0
    assert restored.reply == kept.reply


@pytest.mark.parametrize("flash_attn", [False, True], ids=["v-transposed", "v-rows"])
def test_e2e_chunks_loaded_one_at_a_time_rebuild_the_saved_state_byte_for_byte(
    tmp_path: Path, flash_attn: bool, spy: Spy
) -> None:
    """The real engine on a CPU takes a chain one chunk at a time (through its scratch
    sequence): the context then holds exactly the state it saved, and a prefix of the
    chain (another session's, as a donor) exactly that state cut where the prompts part."""
    service = ChatService(Settings(**SMALL_CHUNKS, flash_attn=flash_attn), home=tmp_path)
    engine = service.load_engine()
    assert engine.capabilities.appends_state
    session = service.sessions.new_session()
    service.send(session.id, "Name three rivers and say where each one flows.")
    tiers = service.host.tiers
    row = tiers.snapshot(session.id)
    assert row is not None and row.format == "chunks"
    assert engine.tokens == row.token_ids  # the context holds what was saved
    saved = bytes(engine.state_get())
    fingerprint = tiers.fingerprint
    assert fingerprint is not None

    tiers.mark_hot(None)
    engine.clear()
    result = tiers.cold.restore(session.id, engine, fingerprint)
    assert result.source == "disk", result.reason
    assert spy.pieces == len(row.chunk_keys) >= 3 and spy.mapped == 0
    assert engine.tokens == row.token_ids
    assert bytes(engine.state_get()) == saved

    keep = 37  # inside a chunk: the chain's last chunk used is cut short
    other = service.sessions.new_session()
    prompt = [*row.token_ids[:keep], *row.token_ids[keep:][::-1]]
    engine.clear()
    result = tiers.cold.restore(other.id, engine, fingerprint, prompt=prompt)
    assert (result.source, result.tokens, result.donor) == ("disk", keep, session.id)
    assert engine.tokens == row.token_ids[:keep]
    cut = bytes(engine.state_get())
    ptr = ctypes.cast(ctypes.c_char_p(saved), ctypes.POINTER(ctypes.c_uint8))
    assert engine.state_set(ptr, len(saved), row.token_ids)
    engine.truncate(keep)
    assert cut == bytes(engine.state_get())
    service.close()


def test_e2e_a_damaged_chunk_of_a_real_state_falls_back_with_the_reason(
    kvhome: Path, spy: Spy
) -> None:
    settings = Settings(**SMALL_CHUNKS)
    service = ChatService(settings)
    session = service.sessions.new_session()
    service.send(session.id, "Name three rivers and say where each one flows.")
    service.close()
    flip_last_byte(next((kvhome / "snapshots" / "chunks").rglob("*.kvc")))

    resumed = ChatService(settings)
    report = resumed.send(session.id, "Which is the longest?")
    assert report.restore.source == "none"
    assert "checksum mismatch" in (report.restore.reason or "")
    assert report.tokens.reused == 0  # a full prefill, and the turn still answered
    assert report.reply
    resumed.close()
