"""Tiered KV memory: chunk layout, shared prefixes, the RAM tier, budgets, forks, cache figures."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from kvchat.config import Settings
from kvchat.engine import EngineConfig
from kvchat.engine.llama import LlamaEngine
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.paths import bundled_model_path
from kvchat.service.chat import ChatService

SMALL_CHUNKS = dict(temperature=0, max_tokens=16, n_ctx=1024, chunk_tokens=32)


@pytest.mark.parametrize("flash_attn", [False, True], ids=["v-transposed", "v-rows"])
def test_reassembled_chunks_equal_the_whole_blob(flash_attn: bool):
    engine = LlamaEngine(EngineConfig(bundled_model_path(), n_ctx=1024, flash_attn=flash_attn))
    tokens = engine.chat_tokens([{"role": "user", "content": "count: " + "one two three " * 40}])
    engine.prefill(tokens)
    blob = np.frombuffer(bytes(engine.state_get()), dtype=np.uint8)
    layout = kvlayout.parse(blob, *engine.kv_shape())
    assert layout.v_trans == (0 if flash_attn else 1)
    n = layout.n_cells
    chunks = [kvlayout.extract(blob, layout, a, min(a + 100, n)) for a in range(0, n, 100)]
    out = np.zeros(len(blob), dtype=np.uint8)
    assert kvlayout.assemble_into(out, layout.describe(), chunks, n) == len(blob)
    assert np.array_equal(out, blob)
    # A prefix cut mid-chunk equals llama.cpp's own state of that prefix.
    engine.truncate(150)
    prefix = np.frombuffer(bytes(engine.state_get()), dtype=np.uint8)
    size = kvlayout.assemble_into(out, layout.describe(), chunks, 150)
    assert np.array_equal(out[:size], prefix)
    engine.close()


def test_parser_rejects_layouts_it_does_not_know():
    engine = LlamaEngine(EngineConfig(bundled_model_path(), n_ctx=256))
    engine.prefill(engine.chat_tokens([{"role": "user", "content": "hello"}]))
    blob = bytes(engine.state_get())
    n_layer, k_width, v_width = engine.kv_shape()
    with pytest.raises(kvlayout.LayoutError, match="layers"):
        kvlayout.parse(blob, n_layer + 1, k_width, v_width)
    with pytest.raises(kvlayout.LayoutError, match="does not match width"):
        kvlayout.parse(blob, n_layer, k_width * 2, v_width)
    with pytest.raises(kvlayout.LayoutError):
        kvlayout.parse(blob + b"\0", n_layer, k_width, v_width)
    with pytest.raises(kvlayout.LayoutError):
        kvlayout.parse(blob[:-1], n_layer, k_width, v_width)
    engine.close()


def chunk_files(home: Path) -> list[Path]:
    return [p for p in (home / "snapshots" / "chunks").rglob("*.kvc")]


def test_each_turn_writes_only_new_chunks_and_resumes_exactly(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS))
    session = service.sessions.new_session()
    first = service.send(session.id, "Name three rivers.")
    second = service.send(session.id, "And three mountains?")
    per_token = second.snapshot.bytes / service.context_tokens
    new_tokens = service.context_tokens - first.snapshot.bytes / per_token
    # Append-only: only the new tokens' KV hits the disk (plus small chunk headers).
    assert second.snapshot.written <= 1.05 * new_tokens * per_token + 4096
    assert second.snapshot.written >= new_tokens * per_token
    assert second.snapshot.chunks_shared >= 1
    service.close()

    # A new process restores the chain and continues exactly like a full prefill.
    resumed = ChatService(Settings(**SMALL_CHUNKS))
    restored = resumed.send(session.id, "Which is the tallest?")
    assert restored.restore.source == "disk"
    assert restored.tokens.reused == restored.restore.tokens
    resumed.close()
    baseline = ChatService(Settings(**SMALL_CHUNKS))
    baseline.store.delete_message(baseline.sessions.messages(session.id)[-1].id)
    again = baseline.regenerate(session.id, no_restore=True)
    assert again.reply == restored.reply
    baseline.close()


def test_forks_share_their_prefix_on_disk(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS))
    parent = service.sessions.new_session()
    service.send(parent.id, "Tell me about the sea. " * 6)
    service.send(parent.id, "More about waves.")
    parent_row = service.store.get_snapshot(parent.id)
    forks = [service.sessions.fork(parent.id) for _ in range(3)]
    for index, child in enumerate(forks):
        report = service.send(child.id, f"Branch {index}: now tell me about ships.")
        assert report.restore.source in ("disk", "ram")
        assert report.tokens.reused == report.restore.tokens >= parent_row.n_tokens
    rows = {r.session_id: r for r in service.store.snapshots()}
    assert set(rows) == {parent.id, *(f.id for f in forks)}
    logical = sum(r.n_bytes for r in rows.values())
    on_disk = service.host.kv().stats()["disk"]["bytes"]
    # The parent's full chunks are stored once, however many branches use them.
    shared_keys = set(rows[parent.id].chunk_keys[:-1])
    for child in forks:
        assert shared_keys <= set(rows[child.id].chunk_keys)
    assert len({k for r in rows.values() for k in r.chunk_keys}) == len(service.store.all_chunks())
    # Disk = the shared prefix once + each branch's own suffix (+ at most one chunk each).
    per_token = parent_row.n_bytes / parent_row.n_tokens
    branches = sum(rows[f.id].n_bytes - parent_row.n_bytes for f in forks)
    assert on_disk <= parent_row.n_bytes + branches + len(forks) * 32 * per_token
    assert on_disk < 0.6 * logical
    files = chunk_files(kvhome)
    assert len(files) == len(service.store.all_chunks())
    assert on_disk < sum(p.stat().st_size for p in files) < on_disk + 512 * len(files)
    service.close()


def test_fork_at_an_earlier_message_borrows_the_shared_prefix(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS))
    parent = service.sessions.new_session()
    service.send(parent.id, "List some fruits. " * 8)
    service.send(parent.id, "Now vegetables.")
    first_reply = service.sessions.messages(parent.id)[1]
    child = service.sessions.fork(parent.id, at_message=first_reply.id)
    assert [m.content for m in service.sessions.messages(child.id)] == [
        m.content for m in service.sessions.messages(parent.id)[:2]
    ]
    service.close()
    service = ChatService(Settings(**SMALL_CHUNKS))  # a new process: nothing hot or in RAM
    report = service.send(child.id, "Now nuts.")
    assert report.restore.source == "disk"
    assert report.restore.donor == parent.id
    assert report.restore.tokens >= 64
    assert report.tokens.reused == report.restore.tokens
    assert report.tokens.decoded == report.tokens.prompt - report.tokens.reused
    service.close()


def test_switching_back_restores_from_ram(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS))
    a = service.sessions.new_session()
    b = service.sessions.new_session()
    first = service.send(a.id, "Say hello.")
    service.send(b.id, "Say goodbye.")
    assert service.kv_location(a.id) == "ram" and service.kv_location(b.id) == "hot"
    back = service.send(a.id, "Again.")
    assert back.restore.source == "ram"
    assert back.tokens.reused == back.restore.tokens
    assert back.tokens.decoded < 32
    assert service.host.kv().stats()["ram"]["hits"] == 1
    del first
    service.close()


def test_ram_budget_zero_falls_through_to_disk(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS, ram_cache_mib=0))
    a = service.sessions.new_session()
    b = service.sessions.new_session()
    service.send(a.id, "Say hello.")
    service.send(b.id, "Say goodbye.")
    assert service.send(a.id, "Again.").restore.source == "disk"
    service.close()


def test_disk_budget_evicts_least_recently_used_snapshots_never_text(kvhome: Path):
    probe = ChatService(Settings(**SMALL_CHUNKS))
    s0 = probe.sessions.new_session()
    one = probe.send(s0.id, "Describe a cat.").snapshot.bytes
    probe.close()
    budget_gib = 2.5 * one / 2**30
    service = ChatService(Settings(**SMALL_CHUNKS, disk_cache_gib=budget_gib))
    sessions = [s0] + [service.sessions.new_session() for _ in range(3)]
    for index, session in enumerate(sessions[1:]):
        service.send(session.id, f"Describe animal number {index}.")
        disk = service.host.kv().stats()["disk"]
        assert disk["bytes"] <= disk["budget_bytes"]
    kept = {r.session_id for r in service.store.snapshots()}
    assert sessions[-1].id in kept and s0.id not in kept
    for session in sessions:  # text is never evicted
        assert [m.role for m in service.sessions.messages(session.id)] == ["user", "assistant"]
    service.close()
    service = ChatService(Settings(**SMALL_CHUNKS, disk_cache_gib=budget_gib))  # nothing hot
    report = service.send(s0.id, "Go on.")
    assert report.restore.source == "none"
    assert report.restore.reason.startswith("its snapshot was evicted to keep the disk budget")
    service.close()


def test_cache_figures_add_up(kvhome: Path, cli):
    fast = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "1024"]
    first = cli(kvhome, "ask", "--new", "Hi", "--json", *fast).json
    second = cli(kvhome, "ask", "--session", first["session"], "Bye", "--json", *fast).json
    fork = cli(kvhome, "fork", first["session"], "--json").json
    stats = cli(kvhome, "cache", "--json").json
    db = sqlite3.connect(kvhome / "kvchat.db")
    chunk_bytes = db.execute("SELECT SUM(n_bytes) FROM kv_chunks").fetchone()[0]
    assert stats["disk"]["snapshots"] == 2  # the session and its fork
    assert stats["disk"]["bytes"] == chunk_bytes
    assert stats["disk"]["logical_bytes"] == 2 * second["snapshot"]["bytes"]
    assert stats["counters"]["restores_disk"] == 1
    assert stats["counters"]["misses"] == 1
    assert stats["counters"]["tokens_restored"] == second["restore"]["tokens"]
    assert stats["counters"]["bytes_restored"] == second["restore"]["bytes"]
    assert stats["counters"]["bytes_written"] == (
        first["snapshot"]["written"] + second["snapshot"]["written"]
    )
    text = cli(kvhome, "cache").stdout
    assert "2 snapshots" in text and "saved by shared prefixes" in text
    cleared = cli(kvhome, "cache", "clear", fork["session"]).stdout
    assert "cleared 1 snapshots" in cleared
    assert cli(kvhome, "cache", "--json").json["disk"]["snapshots"] == 1
    assert len(cli(kvhome, "export", fork["session"], "--format", "json").json["messages"]) == 4


def test_editing_a_past_message_branches_and_reuses_the_shared_prefix(kvhome: Path):
    service = ChatService(Settings(**SMALL_CHUNKS))
    session = service.sessions.new_session()
    service.send(session.id, "Tell me about cats. " * 8)
    service.send(session.id, "And dogs?")
    second_question = service.sessions.messages(session.id)[2]
    branch = service.sessions.edit(session.id, second_question.id, "And birds?")
    assert [m.content for m in service.sessions.messages(branch.id)][-1] == "And birds?"
    assert [m.content for m in service.sessions.messages(session.id)][2] == "And dogs?"  # kept
    service.close()
    service = ChatService(Settings(**SMALL_CHUNKS))  # a new process: nothing hot or in RAM
    report = service.regenerate(branch.id)
    assert report.restore.source == "disk" and report.restore.donor == session.id
    assert report.tokens.reused == report.restore.tokens > 64
    assert report.tokens.decoded == report.tokens.prompt - report.tokens.reused
    service.close()
