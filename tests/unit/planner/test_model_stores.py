"""The models people already have, in other apps' stores: every store is found with its
names and problems, and the picker offers them and says why not where one cannot be used."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.planner.stores import discover
from kvchat.service.chat import ChatService
from tests.tiny_models import FAMILIES, write_tiny

STORE_VARIABLES = ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "LLAMA_CACHE")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(FAMILIES["llama-gqa"], tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
def stores(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory holding the real layouts of Ollama, LM Studio, the Hugging Face
    cache, llama.cpp's cache and a folder of the user's, some entries broken."""
    home = tmp_path / "user"
    monkeypatch.setenv("HOME", str(home))
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    data = tiny.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    # Ollama: a manifest names the model layer's blob by digest.
    ollama = home / ".ollama" / "models"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").write_bytes(data)

    def manifest(path: str, blob_digest: str) -> None:
        target = ollama / "manifests" / "registry.ollama.ai" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        layers = [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
            {"mediaType": "application/vnd.ollama.image.model", "digest": blob_digest},
        ]
        target.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))

    manifest("library/tiny/latest", f"sha256:{digest}")
    other = write_tiny(FAMILIES["llama-gqa"], tmp_path / "other.gguf", seed=1).read_bytes()
    other_digest = hashlib.sha256(other).hexdigest()
    (ollama / "blobs" / f"sha256-{other_digest}").write_bytes(other)
    manifest("someone/helper/v1", f"sha256:{other_digest}")
    manifest("library/gone/latest", "sha256:" + "f" * 64)  # a pull that never finished
    half = ollama / "manifests" / "registry.ollama.ai" / "library" / "half" / "latest"
    half.parent.mkdir(parents=True)
    half.write_text('{"schemaVersion": 2, "layers": [{"mediaType": "appl')  # cut short
    # LM Studio: publisher/repo/file; one file still downloading.
    lmstudio = home / ".lmstudio" / "models" / "acme" / "tiny-GGUF"
    lmstudio.mkdir(parents=True)
    shutil.copyfile(tiny, lmstudio / "tiny-Q8_0.gguf")
    (lmstudio / "tiny-Q4_0.gguf").write_bytes(b"\0" * 4096)
    # The Hugging Face cache: snapshots link to blobs.
    repo = home / ".cache" / "huggingface" / "hub" / "models--acme--tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(data)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    os.symlink(f"../../blobs/{digest}", repo / "snapshots" / "abc123" / "tiny.gguf")
    # llama.cpp's cache: a split model with a part missing.
    cache = home / ".cache" / "llama.cpp"
    cache.mkdir(parents=True)
    shutil.copyfile(tiny, cache / "big-00001-of-00002.gguf")
    # A folder named in model_dirs.
    mine = tmp_path / "my-models"
    mine.mkdir()
    shutil.copyfile(tiny, mine / "mine.gguf")
    return mine


def test_every_store_is_found_with_its_names_and_problems(stores: Path) -> None:
    found = {m.name: m for m in discover([str(stores)])}
    usable = {name for name, m in found.items() if m.usable}
    assert usable == {
        "ollama:tiny:latest",
        "ollama:someone/helper:v1",
        "lmstudio:acme/tiny-GGUF/tiny-Q8_0.gguf",
        "hf:acme/tiny-GGUF/tiny.gguf",
        f"folder:{stores / 'mine.gguf'}",
    }
    assert found["ollama:tiny:latest"].store == "Ollama"
    assert "is not there" in (found["ollama:gone:latest"].problem or "")
    assert "manifest names no model layer" in (found["ollama:half:latest"].problem or "")
    assert "not a GGUF file" in (found["lmstudio:acme/tiny-GGUF/tiny-Q4_0.gguf"].problem or "")
    assert "part 2 of 2 is missing" in (found["llama.cpp:big-00001-of-00002.gguf"].problem or "")
    # Read only: nothing was written into the stores.
    assert not list((stores.parent / "user").rglob("*.tmp"))


def test_the_picker_offers_them_and_says_why_not(stores: Path, kvhome: Path) -> None:
    service = ChatService(load_settings(model_dirs=[str(stores)]))
    try:
        choices = {c.name: c for c in service.models.model_choices()}
    finally:
        service.close()
    tiny = choices["ollama:tiny:latest"]
    assert tiny.present and tiny.source == "Ollama" and tiny.size_bytes
    assert "context" in tiny.fit  # the planner's fit for this machine
    gone = choices["ollama:gone:latest"]
    assert not gone.present and "is not there" in gone.fit and gone.pull_hint is None
