"""A conversation that outgrows n_ctx keeps going with a KV shift, and resumes after a restart.

The history is filled in-process (one model load), then the overflowing turn and the turn
after it run as new `kvchat` processes: both resume from disk. A shifted KV is no longer
bit-identical to a full prefill of the window (RoPE re-rotation), so these tests compare
token counts, not replies.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from kvchat.engine import EngineConfig
from kvchat.engine.llama import SEQ_ID, LlamaEngine
from kvchat.paths import bundled_model_path
from kvchat.service.chat import ChatService
from tests.helpers import greedy_service

N_CTX = 256
MAX_TOKENS = 24
# One thread: on a shared 2-core machine llama.cpp's spinning thread barriers stall.
OVERFLOW = [
    "--temperature",
    "0",
    "--max-tokens",
    str(MAX_TOKENS),
    "--n-ctx",
    str(N_CTX),
    "--threads",
    "1",
]
TOPICS = ["the Moon", "the ocean", "volcanoes", "glaciers", "comets", "deserts", "rivers"]


def message(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"Question {i}: in two sentences, tell me the size, the age and one surprising fact about {topic}."


def service(home: Path) -> ChatService:
    return greedy_service(home, n_ctx=N_CTX, max_tokens=MAX_TOKENS)


def would_overflow(svc: ChatService, session_id: str, text: str) -> bool:
    engine = svc.engine
    session = svc.store.get_session(session_id)
    chat = [m.as_chat() for m in svc.sessions.messages(session_id)] + [
        {"role": "user", "content": text}
    ]
    prompt = engine.chat_tokens(svc.turns.head(session) + chat)
    return len(prompt) > engine.n_ctx - min(MAX_TOKENS, engine.n_ctx // 4)


def positions(state: bytes) -> list[int]:
    """Cell positions in a seq-state blob (u64 magic, u32 n_stream, u32 cells, cells...)."""
    (n_cells,) = struct.unpack_from("<I", state, 12)
    offset, out = 16, []
    for _ in range(n_cells):
        pos, n_seq = struct.unpack_from("<iI", state, offset)
        offset += 8 + 4 * n_seq
        out.append(pos)
    return out


@pytest.fixture(scope="module")
def full_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, int]]:
    """A home whose one session fills n_ctx: the next message (returned index) overflows."""
    home = tmp_path_factory.mktemp("overflow") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAT_HOME", str(home))
        svc = service(home)
        try:
            session = svc.sessions.new_session()
            i = 0
            while not would_overflow(svc, session.id, message(i)):
                report = svc.send(session.id, message(i))
                assert report.dropped_messages == 0
                i += 1
            assert i >= 2
        finally:
            svc.close()
    yield home, session.id, i


def test_overflow_shifts_the_kv_and_decodes_only_the_new_turn(full_home, copy_home, cli):
    source, session, i = full_home
    home = copy_home(source, "shift")
    baseline_home = copy_home(source, "reprefill")
    before = (
        sqlite3.connect(home / "kvchat.db")
        .execute("SELECT n_tokens FROM kv_snapshots WHERE session_id=?", (session,))
        .fetchone()[0]
    )

    shifted = cli(home, "ask", "--session", session, message(i), "--json", *OVERFLOW).json
    baseline = cli(
        baseline_home, "ask", "--session", session, message(i), "--no-restore", "--json", *OVERFLOW
    ).json

    window = shifted["window"]
    assert shifted["restore"]["from"] == "disk"
    assert shifted["restore"]["tokens"] == before
    assert window["dropped_messages"] >= 2
    assert window["shifted_messages"] == window["dropped_messages"]
    assert window["shifted_tokens"] > 0
    assert window["note"] is None
    # Reused: everything in the context except the shifted-out block.
    assert shifted["tokens"]["reused"] == before - window["shifted_tokens"]
    assert shifted["tokens"]["decoded"] == shifted["tokens"]["prompt"] - shifted["tokens"]["reused"]
    assert 0 < shifted["tokens"]["decoded"] < 64  # only the new message
    assert shifted["tokens"]["prompt"] <= N_CTX - MAX_TOKENS
    assert shifted["tokens"]["generated"] > 0 and shifted["reply"]
    # The same turn without the snapshot re-reads the whole kept window.
    assert baseline["window"]["dropped_messages"] == window["dropped_messages"]
    assert baseline["tokens"]["prompt"] == shifted["tokens"]["prompt"]
    assert baseline["tokens"]["decoded"] == baseline["tokens"]["prompt"]
    assert baseline["tokens"]["decoded"] > 3 * shifted["tokens"]["decoded"]

    # A restart after the shift: the post-shift snapshot resumes from disk.
    after = (
        sqlite3.connect(home / "kvchat.db")
        .execute("SELECT n_tokens FROM kv_snapshots WHERE session_id=?", (session,))
        .fetchone()[0]
    )
    nxt = cli(home, "ask", "--session", session, message(i + 1), "--json", *OVERFLOW).json
    assert nxt["restore"]["from"] == "disk"
    assert nxt["restore"]["reason"] is None
    assert nxt["restore"]["tokens"] == after
    assert nxt["tokens"]["reused"] == after - nxt["window"]["shifted_tokens"]
    assert 0 < nxt["tokens"]["decoded"] < 64
    assert nxt["window"]["dropped_messages"] >= window["dropped_messages"]
    assert nxt["reply"]

    # The text that left the window is still in SQLite.
    exported = cli(home, "export", session, "--format", "json").json["messages"]
    assert len(exported) == 2 * (i + 2)
    assert exported[0]["content"] == message(0)


def test_shift_in_process_keeps_tokens_positions_and_cells_in_order(
    full_home, copy_home, monkeypatch
):
    source, session, i = full_home
    home = copy_home(source, "inproc")
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    svc = service(home)
    try:
        report = svc.send(session, message(i))
        engine = svc.engine
        assert report.restore.source == "disk"
        assert report.shifted_tokens > 0 and report.shifted_messages == report.dropped_messages
        assert "KV shift" in report.summary() and "left the window" in report.summary()
        # The context holds the window's prompt (then the reply): tokens and positions agree.
        window = [m.as_chat() for m in svc.sessions.messages(session)[report.dropped_messages :]]
        prompt = engine.chat_tokens(svc.turns.head(svc.store.get_session(session)) + window[:-1])
        assert engine.tokens[: len(prompt)] == prompt
        mem = llama_cpp.llama_get_memory(engine.ctx)
        assert llama_cpp.llama_memory_seq_pos_min(mem, SEQ_ID) == 0
        assert llama_cpp.llama_memory_seq_pos_max(mem, SEQ_ID) == engine.n_tokens - 1
        assert positions(bytes(engine.state_get())) == list(range(engine.n_tokens))
        # A regenerate right after the shift keeps the shifted window: nothing re-read.
        again = svc.regenerate(session)
        assert again.restore.source == "hot"
        assert again.dropped_messages == report.dropped_messages
        assert again.shifted_tokens == 0 and again.window_note is None
        assert again.tokens.prompt == report.tokens.prompt
        assert again.tokens.decoded == 2  # the last prompt tokens again, for their logits
    finally:
        svc.close()


def test_a_model_that_cannot_shift_rereads_only_the_kept_window(full_home, copy_home, monkeypatch):
    source, session, i = full_home
    home = copy_home(source, "noshift")
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    monkeypatch.setattr(LlamaEngine, "can_shift", lambda self: False)
    svc = service(home)
    try:
        report = svc.send(session, message(i))
    finally:
        svc.close()
    assert report.restore.source == "disk"
    assert report.dropped_messages >= 2
    assert report.shifted_tokens == 0
    assert report.window_note and "cannot be shifted" in report.window_note
    assert "re-read the kept window" in report.summary()
    # Only the system prompt's tokens are reused; the kept window is decoded again.
    assert 0 < report.tokens.reused < 40
    assert report.tokens.decoded == report.tokens.prompt - report.tokens.reused
    assert report.reply
    data: dict[str, Any] = report.to_json()
    assert data["window"]["note"] == report.window_note


def test_engine_shift_moves_positions_down_and_keeps_the_token_list():
    path = bundled_model_path()
    assert path is not None
    engine = LlamaEngine(EngineConfig(model_path=path, n_ctx=N_CTX, n_threads=1))
    try:
        messages = [{"role": "user", "content": message(n)} for n in range(3)]
        tokens = engine.chat_tokens(messages)
        engine.prefill(tokens)
        assert engine.can_shift()
        assert engine.shift(10, 30) == 20
        assert engine.tokens == tokens[:10] + tokens[30:]
        mem = llama_cpp.llama_get_memory(engine.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, SEQ_ID) == len(tokens) - 21
        assert positions(bytes(engine.state_get())) == list(range(len(tokens) - 20))
        again = engine.prefill(tokens[:10] + tokens[30:] + tokens[:5])
        assert again.reused == len(tokens) - 20 and again.decoded == 5
        with pytest.raises(ValueError):
            engine.shift(5, engine.n_tokens)
    finally:
        engine.close()
