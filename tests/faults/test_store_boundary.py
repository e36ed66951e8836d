"""One hostile file in another app's model store never stops
`kvchat models list --local`.

The numbered failures as filed (an Ollama manifest of 200,000 ``[``, a 230-byte GGUF that
declares 2^40 blocks, ``head_count "eight"``, store links that lead outside the store, an
HF snapshot link to a missing blob), each as a test, and all of them in one store under the
real `kvchat models list --local`: every good model is listed, every bad entry is one line.

Then a generated campaign (``stress``: 300 cases; a sample of 20 by default): mutated GGUF
headers (cuts, huge counts, flipped bytes, wrong value types), hostile manifests (depth,
size, encodings, types, digests), and links, loops, FIFOs and devices in the stores. Every
case lists the good model, takes bounded time, and says what it did not use in one line;
no model is usable through a path that leaves its store.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kvchat.cli.model_commands import local_models
from kvchat.config import load_settings
from kvchat.errors import KvchatError
from kvchat.planner.gguf_info import read_gguf
from kvchat.planner.stores import discover
from tests.conftest import run_cli
from tests.tiny_models import FAMILIES, write_tiny

STORE_VARIABLES = ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "LLAMA_CACHE")
U8, I32, U32, F32, BOOL, STR, ARR, U64 = 0, 5, 4, 6, 7, 8, 9, 10


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        raw = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARR:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(_value(itype, v) for v in items)
    return struct.pack(
        "<" + {U8: "B", I32: "i", U32: "I", F32: "f", BOOL: "?", U64: "Q"}[vtype], value
    )


def gguf(kv: list[tuple[str, int, Any]], n_tensors: int = 0, n_kv: int | None = None) -> bytes:
    """A GGUF v3 header: ``kv`` as (key, value type, value), no tensors unless declared."""
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kv) if n_kv is None else n_kv)
    for key, vtype, value in kv:
        out += _value(STR, key) + struct.pack("<I", vtype) + _value(vtype, value)
    return out


def model_kv(**override: tuple[int, Any]) -> list[tuple[str, int, Any]]:
    fields: dict[str, tuple[int, Any]] = {
        "general.architecture": (STR, "llama"),
        "llama.block_count": (U32, 2),
        "llama.embedding_length": (U32, 64),
        "llama.attention.head_count": (U32, 8),
        "llama.attention.head_count_kv": (U32, 2),
        "llama.context_length": (U32, 2048),
    }
    fields.update(override)
    return [(key, vtype, value) for key, (vtype, value) in fields.items()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny(FAMILIES["llama-gqa"], path).read_bytes()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home: no store but what a test puts there."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return home


def _lmstudio(home: Path) -> Path:
    folder = home / ".lmstudio" / "models" / "acme" / "repo-GGUF"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _manifest(home: Path, name: str, body: bytes) -> Path:
    path = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "latest").write_bytes(body)
    return path / "latest"


def _listed(home: Path, extra: list[str] | None = None) -> dict[str, dict[str, Any]]:
    rows = local_models(load_settings(model_dirs=extra or []))
    return {row["name"]: row for row in rows}


# --------------------------------------------------------------------------- 37.5, as filed


def test_a_manifest_of_200000_brackets_is_one_line(home: Path, tiny: bytes) -> None:
    _manifest(home, "deep", b"[" * 200_000)
    (_lmstudio(home) / "good.gguf").write_bytes(tiny)
    rows = _listed(home)
    assert rows["lmstudio:acme/repo-GGUF/good.gguf"]["usable"]
    deep = rows["ollama:deep:latest"]
    assert not deep["usable"] and "\n" not in deep["fit"]


def test_a_230_byte_gguf_declaring_2_40_blocks_is_refused_without_allocating(
    tmp_path: Path,
) -> None:
    data = gguf(model_kv(**{"llama.block_count": (U64, 1 << 40)}))
    path = tmp_path / "huge.gguf"
    path.write_bytes(data.ljust(230, b"\0"))
    tracemalloc.start()
    try:
        with pytest.raises(KvchatError) as caught:
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "block_count" in str(caught.value) and "\n" not in str(caught.value)
    assert peak < 16 << 20


@pytest.mark.parametrize(
    "count_at",
    ["tensors", "kv pairs", "array items", "string bytes"],
)
def test_counts_larger_than_the_file_are_refused_at_once(tmp_path: Path, count_at: str) -> None:
    if count_at == "tensors":
        data = gguf(model_kv(), n_tensors=1 << 40)
    elif count_at == "kv pairs":
        data = gguf(model_kv(), n_kv=1 << 40)
    elif count_at == "array items":
        data = gguf(model_kv(**{"tokenizer.ggml.tokens": (ARR, (STR, []))}))
        at = data.rindex(struct.pack("<IQ", STR, 0))
        data = data[:at] + struct.pack("<IQ", STR, 1 << 40) + data[at + 12 :]
    else:
        data = gguf(model_kv(**{"general.name": (STR, "x")}))
        at = data.rindex(struct.pack("<Q", 1) + b"x")
        data = data[:at] + struct.pack("<Q", 1 << 62) + data[at + 8 :]
    path = tmp_path / "liar.gguf"
    path.write_bytes(data)
    started = time.monotonic()
    with pytest.raises(KvchatError, match="not a readable GGUF file"):
        read_gguf(path)
    assert time.monotonic() - started < 2


def test_head_count_eight_makes_that_model_unreadable_in_one_line(home: Path, tiny: bytes) -> None:
    folder = _lmstudio(home)
    (folder / "good.gguf").write_bytes(tiny)
    (folder / "words.gguf").write_bytes(
        gguf(model_kv(**{"llama.attention.head_count": (STR, "eight")}))
    )
    rows = _listed(home)
    assert rows["lmstudio:acme/repo-GGUF/good.gguf"]["usable"]
    words = rows["lmstudio:acme/repo-GGUF/words.gguf"]
    assert not words["usable"] and "head_count" in words["fit"] and "'eight'" in words["fit"]


LINKS = [
    "gguf file",
    "gguf file, relative",
    "gguf via a chain",
    "manifest",
    "ollama blob",
    "split part",
    "folder",
    "hf snapshot file",
    "/dev/zero",
]


@pytest.mark.parametrize("kind", LINKS)
def test_a_link_out_of_the_store_is_not_followed(home: Path, tiny: bytes, kind: str) -> None:
    outside = home.parent / "outside"
    outside.mkdir()
    (outside / "model.gguf").write_bytes(tiny)
    folder = _lmstudio(home)
    (folder / "good.gguf").write_bytes(tiny)
    expect: str
    if kind == "gguf file":
        os.symlink(outside / "model.gguf", folder / "out.gguf")
        expect = "lmstudio:acme/repo-GGUF/out.gguf"
    elif kind == "gguf file, relative":
        os.symlink("../../../../../outside/model.gguf", folder / "out.gguf")
        expect = "lmstudio:acme/repo-GGUF/out.gguf"
    elif kind == "gguf via a chain":
        os.symlink(outside / "model.gguf", home / "hop")
        os.symlink(home / "hop", folder / "out.gguf")
        expect = "lmstudio:acme/repo-GGUF/out.gguf"
    elif kind == "manifest":
        manifest = _manifest(home, "out", b"{}")
        manifest.unlink()
        digest = "a" * 64
        (outside / "manifest").write_text(
            json.dumps(
                {
                    "layers": [
                        {
                            "mediaType": "application/vnd.ollama.image.model",
                            "digest": f"sha256:{digest}",
                        }
                    ]
                }
            )
        )
        os.symlink(outside / "manifest", manifest)
        blobs = home / ".ollama" / "models" / "blobs"
        blobs.mkdir(parents=True)
        (blobs / f"sha256-{digest}").write_bytes(tiny)
        expect = "ollama:out:latest"
    elif kind == "ollama blob":
        digest = "b" * 64
        body = {
            "layers": [
                {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
            ]
        }
        _manifest(home, "blob", json.dumps(body).encode())
        blobs = home / ".ollama" / "models" / "blobs"
        blobs.mkdir(parents=True)
        os.symlink(outside / "model.gguf", blobs / f"sha256-{digest}")
        expect = "ollama:blob:latest"
    elif kind == "split part":
        (folder / "two-00001-of-00002.gguf").write_bytes(tiny)
        os.symlink(outside / "model.gguf", folder / "two-00002-of-00002.gguf")
        expect = "lmstudio:acme/repo-GGUF/two-00001-of-00002.gguf"
    elif kind == "folder":
        os.symlink(outside, folder / "more")
        expect = "lmstudio:acme/repo-GGUF/more"
    elif kind == "hf snapshot file":
        snap = home / ".cache" / "huggingface" / "hub" / "models--a--b" / "snapshots" / "r1"
        snap.mkdir(parents=True)
        os.symlink(outside / "model.gguf", snap / "m.gguf")
        expect = "hf:a/b/m.gguf"
    else:
        os.symlink("/dev/zero", folder / "zero.gguf")
        expect = "lmstudio:acme/repo-GGUF/zero.gguf"
    rows = _listed(home)
    assert rows["lmstudio:acme/repo-GGUF/good.gguf"]["usable"]
    row = rows[expect]
    assert not row["usable"], row
    assert "outside the store" in row["fit"] and "\n" not in row["fit"]


def test_an_hf_link_to_a_missing_blob_is_listed_as_broken(home: Path, tiny: bytes) -> None:
    repo = home / ".cache" / "huggingface" / "hub" / "models--acme--tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / ("c" * 64)).write_bytes(tiny)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    os.symlink(f"../../blobs/{'c' * 64}", snap / "here.gguf")
    os.symlink(f"../../blobs/{'d' * 64}", snap / "gone.gguf")
    found = {m.name: m for m in discover()}
    assert found["hf:acme/tiny-GGUF/here.gguf"].usable  # a link into its own blobs: fine
    gone = found["hf:acme/tiny-GGUF/gone.gguf"]
    assert not gone.usable and "broken link" in (gone.problem or "")


def test_fifos_and_devices_in_a_store_are_never_opened(home: Path, tiny: bytes) -> None:
    folder = _lmstudio(home)
    (folder / "good.gguf").write_bytes(tiny)
    os.mkfifo(folder / "pipe.gguf")
    _manifest(home, "piped", b"{}").unlink()
    os.mkfifo(
        home
        / ".ollama"
        / "models"
        / "manifests"
        / "registry.ollama.ai"
        / "library"
        / "piped"
        / "latest"
    )
    started = time.monotonic()
    rows = _listed(home)
    assert time.monotonic() - started < 30
    assert "FIFO" in rows["lmstudio:acme/repo-GGUF/pipe.gguf"]["fit"]
    assert "FIFO" in rows["ollama:piped:latest"]["fit"]
    assert rows["lmstudio:acme/repo-GGUF/good.gguf"]["usable"]


@pytest.mark.e2e
def test_list_local_goes_on_past_every_filed_case(home: Path, tiny: bytes, kvhome: Path):
    """All of 37.5's inputs at once, through the real command: rc 0, each one line."""
    folder = _lmstudio(home)
    (folder / "good.gguf").write_bytes(tiny)
    (folder / "blocks.gguf").write_bytes(gguf(model_kv(**{"llama.block_count": (U64, 1 << 40)})))
    (folder / "words.gguf").write_bytes(
        gguf(model_kv(**{"llama.attention.head_count": (STR, "eight")}))
    )
    os.symlink("/etc/hostname", folder / "etc.gguf")
    _manifest(home, "deep", b"[" * 200_000)
    snap = home / ".cache" / "huggingface" / "hub" / "models--a--b" / "snapshots" / "r"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/" + "e" * 64, snap / "gone.gguf")
    result = run_cli(kvhome, "models", "list", "--local", env={"HOME": str(home)})
    assert result.returncode == 0 and "Traceback" not in result.stderr
    out = result.stdout
    for name in ("good.gguf", "blocks.gguf", "words.gguf", "etc.gguf", "ollama:deep", "gone.gguf"):
        assert name in out, name
    rows = run_cli(kvhome, "models", "list", "--local", "--json", env={"HOME": str(home)}).json
    usable = {row["name"] for row in rows["models"] if row["usable"]}
    assert usable == {"lmstudio:acme/repo-GGUF/good.gguf"}


# --------------------------------------------------------------------------- the campaign


def _mutated_gguf(rng: random.Random, tiny: bytes) -> bytes:
    header_end = min(len(tiny), 4096)
    how = rng.choice(["cut", "count", "flip", "type"])
    data = bytearray(tiny)
    if how == "cut":
        return bytes(data[: rng.randint(0, header_end)])
    if how == "count":
        at = rng.randrange(4, header_end - 8)
        big = rng.choice([1 << 40, (1 << 64) - 1, 1 << 32, 0x7FFFFFFF, rng.getrandbits(64)])
        data[at : at + 8] = struct.pack("<Q", big)
        return bytes(data)
    if how == "flip":
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(4, header_end)] = rng.randrange(256)
        return bytes(data)
    at = rng.randrange(24, header_end - 4)
    data[at : at + 4] = struct.pack("<I", rng.choice([9, 13, 255, 8, 0xFFFFFFFF]))
    return bytes(data)


def _typed_gguf(rng: random.Random) -> bytes:
    key = rng.choice(
        [
            "llama.block_count",
            "llama.attention.head_count",
            "llama.attention.head_count_kv",
            "llama.embedding_length",
            "llama.context_length",
            "llama.attention.key_length",
            "llama.attention.sliding_window",
            "llama.feed_forward_length",
            "general.architecture",
            "general.file_type",
            "general.name",
            "general.alignment",
        ]
    )
    value = rng.choice(
        [
            (STR, "eight"),
            (STR, "8"),
            (I32, -1),
            (U64, 1 << 40),
            (U64, (1 << 64) - 1),
            (F32, 1.5),
            (F32, float("nan")),
            (F32, float("inf")),
            (BOOL, True),
            (ARR, (U32, [8] * rng.randint(0, 5))),
            (ARR, (STR, ["x"] * 3)),
            (STR, "\x1b[31m" + "é" * 100),
            (U32, 0),
        ]
    )
    return gguf(model_kv(**{key: value}))


def _hostile_manifest(rng: random.Random) -> bytes:
    model = "application/vnd.ollama.image.model"
    return rng.choice(
        [
            b"[" * rng.randint(33, 300_000),
            b'{"layers": ' + b"[" * rng.randint(40, 5000) + b"]" * rng.randint(0, 40) + b"}",
            b"{" * rng.randint(33, 100_000),
            b" " * (300 * 1024),
            os.urandom(rng.randint(0, 2000)),
            b'{"layers": NaN}',
            b'{"layers": [{"mediaType": "' + model.encode() + b'", "digest": 5}]}',
            b'{"layers": [{"mediaType": "' + model.encode() + b'", "digest": "sha256-../../x"}]}',
            b'{"layers": [{"mediaType": "' + model.encode() + b'", "digest": null}]}',
            b'{"layers": {"a": 1}}',
            b'"just a string"',
            b'{"layers": [' + b'"x",' * 20_000 + b'"x"]}',
            b"\xff\xfe" + "{}".encode("utf-16-le"),
            b'{"layers": [{"mediaType": ["'
            + model.encode()
            + b'"], "digest": "sha256:'
            + b"a" * 64
            + b'"}]}',
        ]
    )


def _hostile_link(rng: random.Random, home: Path, folder: Path, outside: Path) -> None:
    kind = rng.choice(
        [
            "out-file",
            "out-dir",
            "loop",
            "self",
            "dev",
            "fifo",
            "fifo-link",
            "dir.gguf",
            "dangling",
            "deep-out",
            "up-and-in",
        ]
    )
    target = folder / f"link{rng.randrange(1000)}.gguf"
    if kind == "out-file":
        os.symlink(outside / "model.gguf", target)
    elif kind == "out-dir":
        os.symlink(outside, folder / "outdir")
    elif kind == "loop":
        os.symlink(folder / "loop-b.gguf", folder / "loop-a.gguf")
        os.symlink(folder / "loop-a.gguf", folder / "loop-b.gguf")
    elif kind == "self":
        for n in range(rng.randint(1, 8)):
            os.symlink(folder, folder / f"again{n}")
    elif kind == "dev":
        os.symlink(rng.choice(["/dev/zero", "/dev/urandom", "/dev/null", "/proc/self/mem"]), target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "fifo-link":
        os.mkfifo(folder / "pipe")
        os.symlink(folder / "pipe", target)
    elif kind == "dir.gguf":
        target.mkdir()
    elif kind == "dangling":
        os.symlink(folder / "nothing-here", target)
    elif kind == "deep-out":
        os.symlink("../" * rng.randint(1, 12) + "outside/model.gguf", target)
    else:  # out of the store and back in: the resolved path is inside, fine
        os.symlink(home / ".lmstudio" / "models" / "acme" / "repo-GGUF" / "good.gguf", target)


def _store_case(seed: int, base: Path, tiny: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    home = base / f"case{seed}" / "user"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    outside = home.parent / "outside"
    outside.mkdir()
    (outside / "model.gguf").write_bytes(tiny)
    folder = _lmstudio(home)
    (folder / "good.gguf").write_bytes(tiny)
    kind = rng.choice(["mutated", "typed", "manifest", "manifest-blob", "link", "link", "hf"])
    if kind == "mutated":
        (folder / "bad.gguf").write_bytes(_mutated_gguf(rng, tiny))
    elif kind == "typed":
        (folder / "bad.gguf").write_bytes(_typed_gguf(rng))
    elif kind == "manifest":
        _manifest(home, "bad", _hostile_manifest(rng))
    elif kind == "manifest-blob":
        digest = f"{rng.getrandbits(256):064x}"
        body = {
            "layers": [
                {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
            ]
        }
        _manifest(home, "bad", json.dumps(body).encode())
        blobs = home / ".ollama" / "models" / "blobs"
        blobs.mkdir(parents=True)
        _hostile_link(rng, home, blobs, outside)
        for made in blobs.iterdir():
            made.rename(blobs / f"sha256-{digest}")
            break
    elif kind == "link":
        _hostile_link(rng, home, folder, outside)
    else:
        snap = home / ".cache" / "huggingface" / "hub" / "models--a--b" / "snapshots" / "r"
        snap.mkdir(parents=True)
        _hostile_link(rng, home, snap, outside)
    started = time.monotonic()
    rows = _listed(home)
    took = time.monotonic() - started
    where = f"seed {seed}: {kind}"
    assert took < 20, where
    assert rows["lmstudio:acme/repo-GGUF/good.gguf"]["usable"], where
    real_outside = outside.resolve()
    for row in rows.values():
        assert "\n" not in row["fit"], (where, row)
        if row["usable"]:
            real = Path(row["path"]).resolve()
            assert not real.is_relative_to(real_outside), (where, row)
            assert real.is_relative_to(home.resolve()), (where, row)


CAMPAIGN = 300
SAMPLE = range(0, CAMPAIGN, CAMPAIGN // 20)


@pytest.mark.parametrize("seed", SAMPLE)
def test_hostile_stores_sample(
    seed: int, tmp_path: Path, tiny: bytes, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _store_case(seed, tmp_path, tiny, monkeypatch)


@pytest.mark.stress
@pytest.mark.parametrize("seed", range(CAMPAIGN))
def test_hostile_stores_campaign(
    seed: int, tmp_path: Path, tiny: bytes, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _store_case(seed, tmp_path, tiny, monkeypatch)
