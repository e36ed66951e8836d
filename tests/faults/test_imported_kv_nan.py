"""NaN and infinity in imported KV fail the first chunk's comparison.

The first chunk of an imported chain is recomputed and compared cell by cell; a NaN made
the comparison pass (``max(0.0, nan)`` is 0.0, and one NaN row made a whole layer's
largest error NaN). Any NaN or infinity on either side must fail: a bundle whose first
chunk holds one f16 NaN every 4 KiB, or 8 KiB of random bytes, is refused, and the
imported session then replies as a full prefill does.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.kvcache.state.recompute import MAX_CELL_ERROR, compare_cells
from tests.conftest import FAST

SMALL_CHUNKS = {"KVCHAT_CHUNK_TOKENS": "16"}
CATS = "Tell me about cats."
F16_NAN = np.array([np.nan], dtype=np.float16).tobytes()
F16_INF = np.array([np.inf], dtype=np.float16).tobytes()

# --- the comparison itself (no model) ---------------------------------------------------

N = 8  # cells
DIMS = 64  # values per K/V row
META = 12  # bytes of cell metadata per cell


def _layout(type_id: int, row_size: int, v_trans: int = 0) -> kvlayout.StateLayout:
    v = (
        kvlayout.LayerData(type_id, 2, 0, DIMS)  # transposed: el_size, one row per dim
        if v_trans
        else kvlayout.LayerData(type_id, row_size, 0)
    )
    return kvlayout.StateLayout(
        n_cells=N,
        meta_offset=0,
        meta_size=N * META,
        cell_meta_size=META,
        v_trans=v_trans,
        n_layer=1,
        k_layers=[
            kvlayout.LayerData(type_id, row_size, 0),
            kvlayout.LayerData(type_id, row_size, 0),
        ],
        v_layers=[v],
    )


def _extract_form(values: list[np.ndarray]) -> np.ndarray:
    """Header, cell metadata, then each section's bytes (as :func:`kvlayout.extract`)."""
    head = np.zeros(8 + N * META, dtype=np.uint8)
    head[8:] = np.arange(N * META) % 251
    return np.concatenate([head, *(v.view(np.uint8).reshape(-1) for v in values)])


def _f16_cells(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((N, DIMS)).astype(np.float16) for _ in range(3)]


def _poisoned(sections: list[np.ndarray], value: bytes, section: int, at: int) -> np.ndarray:
    data = _extract_form(sections)
    offset = 8 + N * META + sum(s.nbytes for s in sections[:section]) + at
    data[offset : offset + 2] = np.frombuffer(value, dtype=np.uint8)
    return data


@pytest.mark.parametrize("value", [F16_NAN, F16_INF, b"\x00\xfc"], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("section", [0, 1, 2], ids=["k0", "k1", "v"])
def test_one_non_finite_value_fails_the_comparison(value: bytes, section: int):
    ours = _f16_cells(1)
    layout = _layout(1, 2 * DIMS)
    genuine = _extract_form(ours)
    assert compare_cells(genuine, genuine, layout, N)[0] == 0.0
    for at in (0, 2 * DIMS * N // 2 + 6, 2 * DIMS * N - 2):  # first, middle, last value
        theirs = _poisoned(ours, value, section, at)
        worst, _ = compare_cells(genuine, theirs, layout, N)
        assert worst == float("inf"), (section, at, worst)
        # A non-finite value in the cells computed here fails as well (nothing to vouch by).
        assert compare_cells(theirs, genuine, layout, N)[0] == float("inf")
        assert compare_cells(theirs, theirs, layout, N)[0] == float("inf")


def test_a_nan_among_near_cells_is_not_hidden_by_a_larger_error_elsewhere():
    """A NaN in one layer and a small (allowed) rounding error in the next: the NaN wins,
    whichever comes first."""
    ours = _f16_cells(2)
    layout = _layout(1, 2 * DIMS)
    near = [s.copy() for s in ours]
    near[1] = (near[1].astype(np.float32) * 1.001).astype(np.float16)
    for section in (0, 2):
        theirs = _poisoned(near, F16_NAN, section, 10)
        assert compare_cells(_extract_form(ours), theirs, layout, N)[0] == float("inf")
    # and without the NaN, rounding passes
    worst, _ = compare_cells(_extract_form(ours), _extract_form(near), layout, N)
    assert 0 < worst <= MAX_CELL_ERROR


def test_transposed_v_with_a_nan_fails():
    ours = _f16_cells(3)
    ours[2] = ours[2].reshape(DIMS, N)  # V transposed: one row per dimension
    layout = _layout(1, 2 * DIMS, v_trans=1)
    assert compare_cells(_extract_form(ours), _extract_form(ours), layout, N)[0] == 0.0
    theirs = _poisoned(ours, F16_NAN, 2, 2 * 5)
    assert compare_cells(_extract_form(ours), theirs, layout, N)[0] == float("inf")


def test_random_bytes_fail_the_comparison():
    ours = _f16_cells(4)
    layout = _layout(1, 2 * DIMS)
    rng = np.random.default_rng(5)
    theirs = _extract_form(ours)
    start = 8 + N * META + 100
    theirs[start : start + 1500] = rng.integers(0, 256, 1500, dtype=np.uint8)
    assert compare_cells(_extract_form(ours), theirs, layout, N)[0] == float("inf")


@pytest.mark.parametrize(("type_id", "block"), [(8, 34), (2, 18)], ids=["q8_0", "q4_0"])
def test_a_quantized_block_whose_scale_is_nan_fails(type_id: int, block: int):
    """q8_0 and q4_0 blocks carry an f16 scale: a NaN or infinite scale fails (q4_0 was
    compared byte by byte, which allowed 5% of its bytes to differ)."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(type_id)
    rng = np.random.default_rng(6)
    sections = [
        np.frombuffer(
            quants.quantize(rng.standard_normal((N, DIMS)).astype(np.float32), kind).tobytes(),
            dtype=np.uint8,
        )
        for _ in range(3)
    ]
    row = DIMS // 32 * block
    layout = _layout(type_id, row)
    genuine = _extract_form(sections)
    worst, note = compare_cells(genuine, genuine, layout, N)
    assert worst == 0.0 and note is None  # decoded, not compared byte by byte
    for value in (F16_NAN, F16_INF):
        theirs = _poisoned(sections, value, 1, 3 * block)  # the scale of a block
        assert compare_cells(genuine, theirs, layout, N)[0] == float("inf")


def test_q4_0_is_decoded_as_llama_cpp_does():
    from gguf import GGMLQuantizationType, quants

    from kvchat.kvcache.state.recompute import _as_float

    values = np.random.default_rng(7).standard_normal((4, 128)).astype(np.float32)
    packed = quants.quantize(values, GGMLQuantizationType.Q4_0)
    decoded = _as_float(np.frombuffer(packed.tobytes(), dtype=np.uint8), 2, 4)
    assert decoded is not None
    np.testing.assert_array_equal(decoded, quants.dequantize(packed, GGMLQuantizationType.Q4_0))


# --- with the real model: a bundle whose first chunk is poisoned -------------------------


def _kv_members(bundle: Path) -> list[str]:
    with zipfile.ZipFile(bundle) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    return [entry["member"] for entry in manifest["kv"]["files"]]


def _rewrite_chunk(raw: bytes, poison: Any, layout: dict[str, Any]) -> bytes:
    """A chunk file with its data changed by ``poison`` and its header's checksum made
    again: what a maker with a broken machine (or a forger) writes."""
    header, data_at = fmt.read_header(raw, fmt.CHUNK_MAGIC, "chunk")
    data = np.frombuffer(raw, dtype=np.uint8, offset=data_at).copy()
    poison(data, layout, header["n_tokens"])
    parts, _ = fmt.chunk_parts(
        header["key"], header["start"], header["start"] + header["n_tokens"], data
    )
    return b"".join(bytes(part) for part in parts)


def _poison_bundle(genuine: Path, member: str, poison: Any, target: Path) -> Path:
    with zipfile.ZipFile(genuine) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    manifest = json.loads(files.pop("manifest.json"))
    files[member] = _rewrite_chunk(files[member], poison, manifest["kv"]["layout"])
    manifest["members"][member] = {
        "sha256": hashlib.sha256(files[member]).hexdigest(),
        "size": len(files[member]),
    }
    with zipfile.ZipFile(target, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("manifest.json", json.dumps(manifest))
    return target


def _nan_every_4k(data: np.ndarray, layout: dict[str, Any], n: int) -> None:
    """One f16 NaN every 4 KiB, past the cells' metadata (which must stay exact)."""
    first = 8 + n * layout["cell_meta_size"]
    for at in range(4096, len(data) - 1, 4096):
        assert at >= first
        data[at : at + 2] = np.frombuffer(F16_NAN, dtype=np.uint8)


def _random_8k(data: np.ndarray, layout: dict[str, Any], n: int) -> None:
    """8 KiB of random bytes from the start of the second layer's K: every row it reaches
    holds a NaN (a random f16 is one 1 time in 32), which made each of those layers' largest
    error NaN, and so ignored."""
    at = 8 + n * layout["cell_meta_size"] + n * layout["k"][0][1]
    data[at : at + 8192] = np.random.default_rng(37).integers(0, 256, 8192, dtype=np.uint8)


@pytest.fixture(scope="module")
def cats_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("nan")
    home = root / "source"
    first = run_cli(home, "ask", "--new", CATS, "--json", *FAST, env=SMALL_CHUNKS).json
    target = root / "cats.kvchat"
    run_cli(
        home, "export", first["session"], "--format", "bundle", "-o", str(target), env=SMALL_CHUNKS
    )
    return target


@pytest.mark.e2e
@pytest.mark.parametrize("poison", [_nan_every_4k, _random_8k], ids=["nan-every-4k", "random-8k"])
def test_a_first_chunk_with_nan_cells_is_refused_and_the_reply_is_a_full_prefills(
    poison, cats_bundle, cli, copy_home, tmp_path
):
    members = _kv_members(cats_bundle)
    assert len(members) >= 2
    poisoned = _poison_bundle(cats_bundle, members[0], poison, tmp_path / "poisoned.kvchat")
    home = tmp_path / "home"
    [item] = cli(home, "import", str(poisoned), "--json", "--n-ctx", "1024").json["sessions"]
    assert item["messages"] == 2 and item["kv"]["tokens"] == 0, item
    assert "not what its own tokens give" in item["kv"]["reason"]
    assert "differ entirely" in item["kv"]["reason"]
    db = sqlite3.connect(home / "kvchat.db")
    assert db.execute("SELECT count(*) FROM kv_chunks").fetchone() == (0,)
    db.close()
    assert list((home / "snapshots").rglob("*.kvc")) == []

    baseline_home = copy_home(home, "baseline")
    ask = ["ask", "--session", item["session"], "And dogs?", "--json", *FAST]
    reply = cli(home, *ask).json
    baseline = cli(baseline_home, *ask, "--no-restore").json
    assert reply["restore"]["tokens"] == 0
    assert reply["reply"] == baseline["reply"] and reply["reply"].strip()
