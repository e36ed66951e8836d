"""A portable bundle resumes from its KV in an empty home like a full prefill; a damaged
bundle, or one from other settings, imports as text only with the reason and leaves no KV
files. The real model."""

from __future__ import annotations

import io
import json
import sqlite3
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST

N_CTX = ["--n-ctx", "1024"]


# --- bundles with KV (the real model) ------------------------------------------------------


def export_bundle(cli, home: Path, session: str, target: Path) -> Path:
    result = cli(home, "export", session, "--format", "bundle", "-o", str(target))
    assert "KV" in result.stderr and target.is_file()
    return target


def import_json(cli, home: Path, path: Path, *flags: str) -> dict[str, Any]:
    [item] = cli(home, "import", str(path), "--json", *N_CTX, *flags).json["sessions"]
    return item


@pytest.mark.parametrize("fmt", ["chunks", pytest.param("blob", marks=pytest.mark.stress)])
def test_a_bundle_resumes_in_an_empty_home_like_a_full_prefill(
    turn_homes, copy_home, cli, tmp_path, fmt
):
    source_home, first = turn_homes(fmt)
    bundle = export_bundle(
        cli, copy_home(source_home, "source"), first["session"], tmp_path / "b.kvchat"
    )
    with zipfile.ZipFile(bundle) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    assert manifest["kv"]["format"] == fmt
    assert (
        manifest["kv"]["n_tokens"] == len(manifest["kv"]["token_ids"]) > first["tokens"]["prompt"]
    )

    home = tmp_path / "empty"
    item = import_json(cli, home, bundle)
    kv = item["kv"]
    assert (kv["tokens"], kv["reason"]) == (manifest["kv"]["n_tokens"], None)
    assert kv["origin"].startswith("bundle:") and kv["check"]["worst"] == 0.0
    baseline_home = copy_home(home, "baseline")
    message = "Tell me one fact about the Moon."

    resumed = cli(home, "ask", "--session", item["session"], message, "--json", *FAST).json
    baseline = cli(
        baseline_home, "ask", "--session", item["session"], message, "--no-restore", "--json", *FAST
    ).json

    assert resumed["restore"]["from"] == "disk" and resumed["restore"]["reason"] is None
    assert resumed["tokens"]["reused"] == manifest["kv"]["n_tokens"]
    assert 0 < resumed["tokens"]["decoded"] < 64
    assert (
        baseline["tokens"]["decoded"] == baseline["tokens"]["prompt"] == resumed["tokens"]["prompt"]
    )
    assert resumed["reply"] == baseline["reply"]


def flip_stored_byte(bundle: Path, member: str, target: Path) -> Path:
    """A copy of ``bundle`` with one byte of ``member``'s data flipped (its CRC now fails)."""
    data = bytearray(bundle.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = zf.getinfo(member)
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len + info.file_size - 100
    data[at] ^= 0x01
    target.write_bytes(bytes(data))
    return target


def test_a_damaged_bundle_imports_text_only_and_leaves_no_kv_files(cli, tmp_path):
    source = tmp_path / "source"
    # Small chunks: the damage is in the last of several, after the first ones were written.
    first = cli(
        source, "ask", "--new", "Hi", "--json", *FAST, env={"KVCHAT_CHUNK_TOKENS": "16"}
    ).json
    bundle = export_bundle(cli, source, first["session"], tmp_path / "b.kvchat")
    with zipfile.ZipFile(bundle) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        kv_members = [entry["member"] for entry in manifest["kv"]["files"]]
        original = {name: zf.read(name) for name in zf.namelist()}
    assert len(kv_members) >= 3
    last = kv_members[-1]

    flipped = flip_stored_byte(bundle, last, tmp_path / "flipped.kvchat")
    # The same damage with a valid zip CRC: only the manifest's sha256 can tell.
    resealed = tmp_path / "resealed.kvchat"
    with zipfile.ZipFile(resealed, "w") as zf:
        for name, data in original.items():
            if name == last:
                data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
            zf.writestr(name, data)

    for path, reason in (
        (flipped, f"{last} is corrupt (Bad CRC-32"),
        (resealed, f"{last} fails its sha256 check"),
    ):
        home = tmp_path / f"home-{path.stem}"
        item = import_json(cli, home, path)
        assert item["kv"]["tokens"] == 0 and item["kv"]["reason"].startswith(reason)
        assert item["messages"] == 2
        db = sqlite3.connect(home / "kvchat.db")
        assert db.execute("SELECT count(*) FROM kv_snapshots").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM kv_chunks").fetchone() == (0,)
        assert list((home / "snapshots").rglob("*.kvc")) == []
        listed = cli(home, "export", item["session"], "--format", "json").stdout
        assert json.loads(listed)["messages"][1]["content"] == first["reply"]


def test_a_bundle_from_other_settings_imports_text_only_with_the_reason(
    one_turn_home, copy_home, cli, tmp_path
):
    home, first = one_turn_home
    bundle = export_bundle(cli, copy_home(home, "source"), first["session"], tmp_path / "b.kvchat")
    item = import_json(cli, tmp_path / "q8", bundle, "--kv-type", "q8_0")
    assert item["kv"]["tokens"] == 0
    assert "type_k=f16" in item["kv"]["reason"] and "type_k=q8_0" in item["kv"]["reason"]
    text_only = import_json(cli, tmp_path / "text", bundle, "--no-kv")
    assert text_only["kv"]["tokens"] == 0
    assert text_only["kv"]["reason"] == "text only was asked for (--no-kv)"
    assert text_only["messages"] == item["messages"] == 2
