"""A snapshot that can't be trusted falls back to a full prefill, says why, and loses nothing."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.paths import bundled_model_path
from tests.conftest import FAST

NEXT = "And then?"


def snapshot_file(home: Path) -> Path:
    """The file holding the newest tokens' KV: the blob, or the chain's last chunk."""
    db = sqlite3.connect(home / "kvchat.db")
    fmt, path, keys = db.execute("SELECT format, path, chunk_keys FROM kv_snapshots").fetchone()
    if fmt == "blob":
        return home / "snapshots" / path
    (chunk,) = db.execute(
        "SELECT path FROM kv_chunks WHERE key = ?", (json.loads(keys)[-1],)
    ).fetchone()
    return home / "snapshots" / "chunks" / chunk


def truncate(home: Path) -> None:
    path = snapshot_file(home)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1000)


def flip_byte(home: Path) -> None:
    path = snapshot_file(home)
    data = bytearray(path.read_bytes())
    data[len(data) - 12345] ^= 0x40
    path.write_bytes(bytes(data))


def delete_file(home: Path) -> None:
    snapshot_file(home).unlink()


def foreign_file(home: Path) -> None:
    snapshot_file(home).write_bytes(b"GGUF" + b"\0" * 4096)


def assert_fallback_matches_baseline(cli, home, baseline_home, session, reason, extra=()):
    fallback = cli(home, "ask", "--session", session, NEXT, "--json", *FAST, *extra).json
    baseline = cli(
        baseline_home, "ask", "--session", session, NEXT, "--no-restore", "--json", *FAST, *extra
    ).json
    assert fallback["restore"]["from"] == "none"
    assert reason in fallback["restore"]["reason"]
    assert fallback["tokens"]["reused"] == 0
    assert fallback["tokens"]["decoded"] == fallback["tokens"]["prompt"]
    assert fallback["reply"] == baseline["reply"]
    assert fallback["reply"]
    # Nothing lost: both turns are in the transcript, and the next turn resumes again.
    messages = cli(home, "export", session, "--format", "json").json["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    again = cli(home, "ask", "--session", session, "Thanks.", "--json", *FAST, *extra).json
    assert again["restore"]["from"] == "disk"
    return fallback


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (truncate, "truncated"),
        (flip_byte, "checksum mismatch"),
        (delete_file, "snapshot file is missing"),
        (foreign_file, "not a kvchat snapshot file"),
    ],
    ids=["truncated", "flipped-byte", "missing", "foreign"],
)
@pytest.mark.parametrize("fmt", ["chunks", pytest.param("blob", marks=pytest.mark.stress)])
def test_damaged_snapshot_falls_back_with_its_reason(
    turn_homes, copy_home, cli, damage, reason, fmt
):
    source, first = turn_homes(fmt)
    home = copy_home(source, "damaged")
    baseline_home = copy_home(source, "baseline")
    damage(home)
    assert_fallback_matches_baseline(cli, home, baseline_home, first["session"], reason)


def test_snapshot_from_a_different_model_file_falls_back(tmp_path, copy_home, cli):
    """A copy of the GGUF with changed metadata has the same shapes, so llama.cpp would load
    its KV without complaint; the fingerprint must refuse it."""
    other_model = tmp_path / "renamed.gguf"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gguf.scripts.gguf_new_metadata",
            "--general-name",
            "Not SmolLM",
            str(bundled_model_path()),
            str(other_model),
        ],
        check=True,
        capture_output=True,
    )
    home = tmp_path / "home"
    first = cli(home, "ask", "--new", "Hi", "--json", "--model", str(other_model), *FAST).json
    baseline_home = copy_home(home, "baseline")
    fallback = assert_fallback_matches_baseline(
        cli, home, baseline_home, first["session"], "different model file"
    )
    assert "renamed.gguf" in fallback["restore"]["reason"]


def test_context_too_small_for_the_snapshot_falls_back(tmp_path, copy_home, cli):
    home = tmp_path / "home"
    long_message = "Please remember these words: " + ", ".join(["apple", "river", "stone"] * 40)
    first = cli(home, "ask", "--new", long_message, "--json", *FAST).json
    assert first["tokens"]["prompt"] > 256
    baseline_home = copy_home(home, "baseline")
    fallback = assert_fallback_matches_baseline(
        cli, home, baseline_home, first["session"], "n_ctx is 256", extra=("--n-ctx", "256")
    )
    # The long first exchange no longer fits: it left the window but stays in SQLite.
    assert fallback["window"]["dropped_messages"] == 2


def test_different_kv_type_falls_back(one_turn_home, copy_home, cli):
    home = copy_home(one_turn_home[0], "q8")
    baseline_home = copy_home(one_turn_home[0], "baseline")
    env = {"KVCHAT_TYPE_K": "q8_0"}
    session = one_turn_home[1]["session"]
    fallback = cli(home, "ask", "--session", session, NEXT, "--json", *FAST, env=env).json
    baseline = cli(
        baseline_home, "ask", "--session", session, NEXT, "--no-restore", "--json", *FAST, env=env
    ).json
    assert fallback["restore"]["from"] == "none"
    assert "KV type is type_k=f16" in fallback["restore"]["reason"]
    assert "type_k=q8_0" in fallback["restore"]["reason"]
    assert fallback["reply"] == baseline["reply"]
    again = cli(home, "ask", "--session", session, "Thanks.", "--json", *FAST, env=env).json
    assert again["restore"]["from"] == "disk"


@pytest.mark.parametrize("fmt", ["chunks", pytest.param("blob", marks=pytest.mark.stress)])
def test_snapshot_row_and_file_disagreeing_falls_back(turn_homes, copy_home, cli, fmt):
    source, first = turn_homes(fmt)
    home = copy_home(source, "edited-row")
    baseline_home = copy_home(source, "baseline")
    db = sqlite3.connect(home / "kvchat.db")
    with db:
        db.execute("UPDATE kv_snapshots SET checksum = 'ffff' || substr(checksum, 5)")
    assert_fallback_matches_baseline(
        cli, home, baseline_home, first["session"], "does not match its index row"
    )
