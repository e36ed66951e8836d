"""Chunk restores read each chunk file straight into llama.cpp's layout (issue 14 item 1):
one chunk at a time into the engine when its KV is in host memory, else into one whole
state buffer. The state they rebuild is byte for byte the saved one in both V layouts
(rows with flash attention on, transposed with it off), a chunk the restore cuts short or
a file unlike its row goes through the mapped reader, and a damaged chunk is a fallback
with its reason.

Model-free tests first (a synthetic state in llama.cpp's layout); the end-to-end ones run
the real model and compare the continuation with a full prefill's.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvchat.config import Settings
from kvchat.engine import EngineCapabilities
from kvchat.kvcache import SnapshotStore
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chunk_reader import ChunkReader, PieceReader
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.service.chat import ChatService
from kvchat.store import Store
from tests.stand_in_engine import EngineDefaults

FP = Fingerprint("id0", "m.gguf", "0.3", "f16", "f16", False, 10000.0, 1.0, 0, 2)
N_LAYER, WIDTH, CHUNK = 3, 8, 16
LAYOUTS = pytest.mark.parametrize("v_trans", [0, 1], ids=["v-rows", "v-transposed"])


def seq_state(n_cells: int, seed: int, v_trans: int) -> bytes:
    """A single-stream seq state in llama.cpp's layout: f16 K rows, then V as rows or
    transposed (per layer: type, element size, dims, then every cell's element per dim)."""
    rng = np.random.default_rng(seed)
    out = bytearray(struct.pack("<QII", 0x5EED, 1, n_cells))
    for pos in range(n_cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", v_trans, N_LAYER)
    for _ in range(N_LAYER):
        out += struct.pack("<iQ", 1, WIDTH * 2) + rng.bytes(WIDTH * 2 * n_cells)
    for _ in range(N_LAYER):
        if v_trans:
            out += struct.pack("<iII", 1, 2, WIDTH) + rng.bytes(WIDTH * 2 * n_cells)
        else:
            out += struct.pack("<iQ", 1, WIDTH * 2) + rng.bytes(WIDTH * 2 * n_cells)
    return bytes(out)


class Engine(EngineDefaults):
    """The seq-state side of an engine, holding a synthetic state."""

    # The whole-state path: a synthetic state can't be appended piece by piece.
    capabilities = EngineCapabilities(seq_state=True)

    def __init__(self, tokens: list[int], v_trans: int, seed: int = 0) -> None:
        self.tokens = tokens
        self.state = seq_state(len(tokens), seed, v_trans)
        self.n_ctx = 4096
        self.loaded: bytes | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def state_get(self) -> memoryview:
        return memoryview(self.state)

    def kv_shape(self) -> tuple[int, int, int]:
        return (N_LAYER, WIDTH, WIDTH)

    def state_buffer(self, size: int) -> Any:
        return (ctypes.c_uint8 * (size + 100))()  # larger than asked, as the engine's is

    def state_set(self, buf: Any, n_bytes: int, tokens: list[int]) -> bool:
        self.loaded = ctypes.string_at(buf, n_bytes)
        return True

    def state_size(self) -> int:
        return len(self.state)

    def clear(self) -> None:
        self.loaded = None


class Spy:
    """Counts the chunks the direct readers took (``pieces``: one at a time into the
    engine, as the real engine on a CPU loads them) and those left to the mapped reader."""

    def __init__(self) -> None:
        self.direct = 0
        self.pieces = 0
        self.mapped = 0


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    counts = Spy()

    def counting(read: Any, pieces: bool) -> Any:
        def counted(self: Any, *args: Any) -> Any:
            result = read(self, *args)
            if result is None:
                counts.mapped += 1
            else:
                counts.direct += 1
                counts.pieces += pieces
            return result

        return counted

    monkeypatch.setattr(ChunkReader, "read", counting(ChunkReader.read, False))
    monkeypatch.setattr(PieceReader, "read", counting(PieceReader.read, True))
    return counts


def saved(tmp_path: Path, v_trans: int, n: int = 70) -> tuple[SnapshotStore, str, Engine]:
    store = Store(tmp_path / "kvchat.db")
    snapshots = SnapshotStore(tmp_path / "snapshots", store, chunk_tokens=CHUNK)
    session = store.create_session("s").id
    engine = Engine(list(range(100, 100 + n)), v_trans)
    result = snapshots.save(session, engine, FP)
    assert result.row.format == "chunks" and result.chunks_written == -(-n // CHUNK)
    return snapshots, session, engine


def chunk_paths(snapshots: SnapshotStore, session: str) -> list[Path]:
    row = snapshots.store.get_snapshot(session)
    assert row is not None
    return [snapshots.chunk_dir / fmt.chunk_name(key) for key in row.chunk_keys]


@LAYOUTS
def test_every_chunk_lands_straight_in_the_state(tmp_path: Path, v_trans: int, spy: Spy) -> None:
    snapshots, session, saved_engine = saved(tmp_path, v_trans)
    engine = Engine(saved_engine.tokens, v_trans, seed=9)
    result = snapshots.restore(session, engine, FP)
    assert result.source == "disk", result.reason
    assert engine.loaded == saved_engine.state
    assert (spy.direct, spy.mapped) == (5, 0)  # 16 + 16 + 16 + 16 + 6 tokens


@LAYOUTS
def test_a_prefix_cut_mid_chunk_equals_the_state_of_that_prefix(
    tmp_path: Path, v_trans: int, spy: Spy
) -> None:
    snapshots, donor, saved_engine = saved(tmp_path, v_trans)
    other = snapshots.store.create_session("fork").id
    prompt = saved_engine.tokens[:40] + [7, 7, 7]
    engine = Engine(prompt, v_trans, seed=9)
    result = snapshots.restore(other, engine, FP, prompt=prompt)
    assert (result.source, result.tokens, result.donor) == ("disk", 40, donor)
    state = np.frombuffer(saved_engine.state, dtype=np.uint8)
    layout = kvlayout.parse(state, N_LAYER, WIDTH, WIDTH)
    chunks = [kvlayout.extract(state, layout, a, min(a + CHUNK, 70)) for a in range(0, 70, CHUNK)]
    expected = np.zeros(len(state), dtype=np.uint8)
    size = kvlayout.assemble_into(expected, layout.describe(), chunks, 40)
    assert engine.loaded == expected[:size].tobytes()
    assert (spy.direct, spy.mapped) == (2, 1)  # the chunk cut at 40 goes the mapped way


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def move_start(path: Path) -> None:
    """The header names another start (same length, so the size still matches)."""
    data = path.read_bytes()
    assert b'"start": 16' in data
    path.write_bytes(data.replace(b'"start": 16', b'"start": 17', 1))


def bad_magic(path: Path) -> None:
    path.write_bytes(b"XXXXXXXX" + path.read_bytes()[8:])


@LAYOUTS
@pytest.mark.parametrize(
    "damage, reason",
    [
        (flip_last_byte, "checksum mismatch"),
        (truncate, "truncated or padded"),
        (move_start, "does not match its index row"),
        (bad_magic, "bad magic"),
    ],
    ids=["flipped-bit", "truncated", "other-start", "bad-magic"],
)
def test_a_damaged_chunk_falls_back_with_its_reason_and_is_written_again(
    tmp_path: Path, v_trans: int, damage: Any, reason: str
) -> None:
    snapshots, session, saved_engine = saved(tmp_path, v_trans)
    damage(chunk_paths(snapshots, session)[1])
    engine = Engine(saved_engine.tokens, v_trans, seed=9)
    result = snapshots.restore(session, engine, FP)
    assert result.source == "none"
    assert reason in (result.reason or "")
    assert engine.loaded is None  # nothing reached llama.cpp
    # The bad chunk was forgotten: the next save writes it again, and it restores.
    again = snapshots.save(session, saved_engine, FP)
    assert again.chunks_written == 1
    result = snapshots.restore(session, engine, FP)
    assert result.source == "disk", result.reason
    assert engine.loaded == saved_engine.state


def test_the_direct_reader_leaves_a_chunk_longer_than_the_state_to_the_mapped_one(
    tmp_path: Path,
) -> None:
    snapshots, session, saved_engine = saved(tmp_path, 0)
    row = snapshots.store.get_snapshot(session)
    assert row is not None and row.layout is not None
    entry = snapshots.store.get_chunks(row.chunk_keys)[row.chunk_keys[-1]]
    layout = kvlayout.layout_for(row.layout, 66)  # the last chunk (64-70) would overflow
    reader = ChunkReader(np.zeros(layout.total, dtype=np.uint8), layout)
    path = snapshots.chunk_dir / fmt.chunk_name(entry.key)
    assert reader.read(path, entry, 64) is None
    with pytest.raises(kvlayout.LayoutError):
        ChunkReader(np.zeros(layout.total - 1, dtype=np.uint8), layout)


# --- end to end: the real model --------------------------------------------------------

SMALL_CHUNKS = dict(temperature=0, max_tokens=16, n_ctx=1024, chunk_tokens=16)


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
