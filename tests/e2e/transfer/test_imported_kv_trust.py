"""Imported KV in its own trust domain, with the real model.

A forger can put another conversation's real KV under a bundle's tokens and recompute the
manifest's hashes. The first chunk is recomputed at import (a forged first chunk is
refused); a forgery past it installs, but only for the imported session: a session made
here never borrows it, and its greedy replies equal a full prefill's.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST

SMALL_CHUNKS = {"KVCHAT_CHUNK_TOKENS": "16"}
CATS = "Tell me about cats."


def _ask(cli, home: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return cli(home, "ask", *args, "--json", *FAST, env=env).json


def _bundle(cli, home: Path, session: str, target: Path) -> Path:
    cli(home, "export", session, "--format", "bundle", "-o", str(target), env=SMALL_CHUNKS)
    return target


def forge(genuine: Path, donor: Path, members: list[str], target: Path) -> Path:
    """``genuine`` with the KV ``members`` taken from ``donor`` (same cuts, another
    conversation's cells) and the manifest's sha256 and sizes recomputed: what a forger
    who knows the format can make."""
    with zipfile.ZipFile(genuine) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    with zipfile.ZipFile(donor) as zf:
        for name in members:
            files[name] = zf.read(name)
    manifest = json.loads(files.pop("manifest.json"))
    for name in members:
        manifest["members"][name] = {
            "sha256": hashlib.sha256(files[name]).hexdigest(),
            "size": len(files[name]),
        }
    with zipfile.ZipFile(target, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("manifest.json", json.dumps(manifest))
    return target


def _kv_members(bundle: Path) -> list[str]:
    with zipfile.ZipFile(bundle) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    return [entry["member"] for entry in manifest["kv"]["files"]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cats conversation's bundle, a rain one's (same system prompt: same first chunk),
    and a weather bot's (another system prompt: another first chunk), 16-token chunks."""
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("forge")
    home = root / "source"
    out: dict[str, Path] = {}
    for name, args in (
        ("cats", ["--new", CATS]),
        ("rain", ["--new", "Tell me about rain."]),
        ("bot", ["--new", "--system", "You are a weather bot. Talk of rain.", CATS]),
    ):
        first = run_cli(home, "ask", *args, "--json", *FAST, env=SMALL_CHUNKS).json
        out[name] = root / f"{name}.kvchat"
        run_cli(
            home,
            "export",
            first["session"],
            "--format",
            "bundle",
            "-o",
            str(out[name]),
            env=SMALL_CHUNKS,
        )
    return out


def test_a_forged_first_chunk_is_caught_by_recomputing_it(bundles, cli, tmp_path):
    members = _kv_members(bundles["cats"])
    forged = forge(bundles["cats"], bundles["bot"], members[:1], tmp_path / "forged.kvchat")
    home = tmp_path / "home"
    [item] = cli(home, "import", str(forged), "--json", "--n-ctx", "1024").json["sessions"]
    assert item["kv"]["tokens"] == 0 and item["messages"] == 2
    assert "not what its own tokens give" in item["kv"]["reason"]
    db = sqlite3.connect(home / "kvchat.db")
    assert db.execute("SELECT count(*) FROM kv_chunks").fetchone() == (0,)
    assert list((home / "snapshots").rglob("*.kvc")) == []

    # The genuine bundle passes the same check, and the import says where its KV is from.
    line = cli(tmp_path / "other", "import", str(bundles["cats"]), "--n-ctx", "1024").stdout
    assert "made elsewhere" in line and "recomputed here and matched" in line
    assert len(line.strip().splitlines()) == 1


def test_a_forged_bundle_never_changes_a_conversation_started_here(
    bundles, cli, copy_home, tmp_path
):
    members = _kv_members(bundles["cats"])
    assert len(members) >= 3
    # Chunks after the first from the rain conversation: the check of the first one passes
    # (what it does not prove), so the forged KV is installed for the imported session.
    forged = forge(bundles["cats"], bundles["rain"], members[1:-1], tmp_path / "forged.kvchat")
    home = tmp_path / "home"
    [item] = cli(home, "import", str(forged), "--json", "--n-ctx", "1024").json["sessions"]
    assert item["kv"]["tokens"] > 35 and item["kv"]["origin"].startswith("bundle:")

    baseline_home = copy_home(home, "baseline")
    fresh = _ask(cli, home, "--new", CATS)
    baseline = _ask(cli, baseline_home, "--new", CATS, "--no-restore")
    assert fresh["restore"]["donor"] is None and fresh["restore"]["tokens"] == 0
    assert fresh["reply"] == baseline["reply"]

    # Its next turn, and another new session, share nothing with the imported chunks.
    again = _ask(cli, home, "--session", fresh["session"], "And dogs?")
    again_baseline = _ask(
        cli, baseline_home, "--session", baseline["session"], "And dogs?", "--no-restore"
    )
    assert again["reply"] == again_baseline["reply"]
    other = _ask(cli, home, "--new", CATS)
    assert other["restore"]["donor"] in (None, fresh["session"])
    assert other["reply"] == fresh["reply"]
    db = sqlite3.connect(home / "kvchat.db")
    rows = dict(db.execute("SELECT session_id, chunk_keys FROM kv_snapshots").fetchall())
    imported = set(json.loads(rows[item["session"]]))
    for session in (fresh["session"], other["session"]):
        assert imported.isdisjoint(json.loads(rows[session]))

    # The imported session itself uses the KV its user accepted.
    own = _ask(cli, home, "--session", item["session"], "And dogs?")
    assert own["restore"]["from"] == "disk" and own["restore"]["tokens"] == item["kv"]["tokens"]
