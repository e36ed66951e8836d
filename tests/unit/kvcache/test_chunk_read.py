"""Chunk restores read each chunk file straight into llama.cpp's layout: one chunk at a
time into the engine when its KV is in host memory, else into one whole state buffer. The
state they rebuild is byte for byte the saved one in both V layouts (rows with flash
attention on, transposed with it off), a chunk the restore cuts short or a file unlike its
row goes through the mapped reader, and a damaged chunk is a fallback with its reason.

Model-free: a synthetic state in llama.cpp's layout (the real model's are in
tests/e2e/resume/test_chunk_restore.py)."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvchat.engine import EngineCapabilities
from kvchat.kvcache import SnapshotStore
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chunk_reader import ChunkReader, PieceReader
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.state import ranges as kvlayout
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
