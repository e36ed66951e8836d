"""What the snapshot code may touch, end to end (the real model, the `kvchat` CLI): a path
column pointing outside deletes nothing and falls back, a symlinked snapshot dir is left
alone, swapped chunk keys fall back, and a damaged row fails only its own session."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chains import KEYS_MISMATCH
from tests.conftest import FAST
from tests.unit.kvcache.test_kvcache_safety import age, home, sql, tree

__all__ = ["home"]  # fixtures shared with the module they come from


# --- end to end: the real model through the CLI ---------------------------------------------


def ask(cli, home: Path, session: str | None, text: str, **kwargs: Any) -> dict[str, Any]:
    where = ["--session", session] if session else ["--new"]
    return cli(home, "ask", *where, text, "--json", *FAST, **kwargs).json


@pytest.mark.parametrize("fmt_name", ["chunks", pytest.param("blob", marks=pytest.mark.stress)])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_e2e_a_path_column_outside_deletes_nothing_and_falls_back(
    turn_homes, copy_home, cli, tmp_path, fmt_name, where
):
    from tests.conftest import SNAPSHOT_FORMATS

    source, first = turn_homes(fmt_name)
    home = copy_home(source, "hostile-path")
    victim = tmp_path / "victim.kvc"
    victim.write_bytes(b"the user's file")
    age(victim)
    # Relative to the directory the row's path is read from: snapshots/ or snapshots/chunks/.
    up = "../../../" if fmt_name == "chunks" else "../../"
    name = up + victim.name if where == "relative" else str(victim)
    assert victim.parent == home.parent
    if fmt_name == "chunks":
        sql(home, "UPDATE kv_chunks SET path=?", name)
    else:
        sql(home, "UPDATE kv_snapshots SET path=?", name)
    env = SNAPSHOT_FORMATS[fmt_name]
    report = ask(cli, home, first["session"], "And then?", env=env)
    assert report["restore"]["from"] == "none"
    assert "not its own" in report["restore"]["reason"]
    cli(home, "list")
    cli(home, "cache", "gc")
    again = ask(cli, home, first["session"], "Thanks.", env=env)
    assert again["restore"]["from"] == "disk"
    assert victim.read_bytes() == b"the user's file"


def test_e2e_a_symlinked_snapshot_dir_is_left_alone(cli, tmp_path):
    home = tmp_path / "home"
    user = tmp_path / "user-folder"
    user.mkdir()
    os.chmod(user, 0o755)
    for name in ("notes.tmp", "a.kvs", "deadbeef-1.kvs", "x.kvc", "deadbeef-2.kvs.999999999.tmp"):
        (user / name).write_bytes(b"mine")
        age(user / name)
    before = tree(user)
    home.mkdir()
    (home / "snapshots").symlink_to(user)
    cli(home, "list")
    cli(home, "cache", "gc")
    report = ask(cli, home, None, "Hi")
    assert report["reply"]
    assert report["restore"]["from"] == "none"
    second = ask(cli, home, report["session"], "And then?")  # a new process: nothing hot
    assert second["restore"]["from"] == "none"
    assert "snapshots are disabled" in second["restore"]["reason"]
    cli(home, "cache")
    assert tree(user) == before


def test_e2e_swapped_chunk_keys_fall_back(kvhome, cli):
    a = ask(cli, kvhome, None, "Tell me about the rain.")
    b = ask(cli, kvhome, None, "Tell me about the cats.")
    db = sqlite3.connect(kvhome / "kvchat.db")
    (keys,) = db.execute(
        "SELECT chunk_keys FROM kv_snapshots WHERE session_id=?", (b["session"],)
    ).fetchone()
    counts = dict(db.execute("SELECT session_id, n_tokens FROM kv_snapshots"))
    db.close()
    # Same length: before rows were bound to their tokens, b's KV loaded as a's.
    assert counts[a["session"]] == counts[b["session"]]
    sql(
        kvhome,
        "UPDATE kv_snapshots SET chunk_keys=?, checksum=? WHERE session_id=?",
        keys,
        fmt.chain_checksum(json.loads(keys)),
        a["session"],
    )
    report = ask(cli, kvhome, a["session"], "And then?")
    assert report["restore"]["from"] == "none"
    assert KEYS_MISMATCH in report["restore"]["reason"]
    assert ask(cli, kvhome, b["session"], "And then?")["restore"]["from"] == "disk"


def test_e2e_a_damaged_row_fails_only_its_session(kvhome, cli):
    a = ask(cli, kvhome, None, "Say hello.")
    b = ask(cli, kvhome, None, "Say goodbye.")
    sql(kvhome, "UPDATE kv_snapshots SET token_ids=? WHERE session_id=?", b"\0" * 7, a["session"])
    assert cli(kvhome, "list").returncode == 0
    assert cli(kvhome, "cache", "--json").json["disk"]["snapshots"] == 2
    other = ask(cli, kvhome, b["session"], "Again.")
    assert other["restore"]["from"] == "disk"
    damaged = ask(cli, kvhome, a["session"], "Again.")
    assert damaged["restore"]["from"] == "none"
    assert "not whole tokens" in damaged["restore"]["reason"]
    cli(kvhome, "cache", "gc")
    assert ask(cli, kvhome, a["session"], "Once more.")["restore"]["from"] == "disk"
