"""The document library: ``kvchat docs add`` reads a document ahead of time, so a new
conversation about it (``ask --new --doc``) decodes only its question (llama.cpp's count)
and replies as a full prefill does; Ctrl+C during the read stores nothing; ``docs list``
shows its figures and a file changed on disk; another KV type is said to be another read;
its KV is kept from the disk budget until ``docs rm``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvchat.engine import common_prefix
from tests.conftest import REPO, clean_env
from tests.e2e.attachments.test_read_once import chatml_tokens, manual

FLAGS = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "4096", "--json"]
QUESTION = "What colour is the valve in room 12?"
LINES = 40  # about 1,100 tokens: a read of several seconds here (Ctrl+C lands inside it)
SMALL = 14  # about 400 tokens: the library's bookkeeping, read four times


def docs_list(cli, home: Path) -> list[dict]:
    return cli(home, "docs", "list", "--json").json["documents"]


def test_ctrl_c_during_a_read_stores_nothing(kvhome: Path, cli, tmp_path: Path) -> None:
    path = tmp_path / "valves.txt"
    path.write_text(manual(LINES) + "\n")
    env = clean_env() | {"KVCHAT_HOME": str(kvhome)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "docs", "add", str(path), "--n-ctx", "4096"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the progress line: the read is under way
    assert "reading valves.txt" in first and "tokens" in first, first
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "valves.txt: cancelled; nothing stored" in out
    assert err.strip().splitlines()[-1].startswith("kvchat: cancelled")
    assert "Traceback" not in err
    assert docs_list(cli, kvhome) == []
    assert cli(kvhome, "cache", "--json").json["disk"]["snapshots"] == 0


def test_a_library_document_starts_a_conversation_with_no_prefill_and_is_kept_until_removed(
    kvhome: Path, copy_home, cli, tmp_path: Path
) -> None:
    path = tmp_path / "valves.txt"
    path.write_text(manual(SMALL) + "\n")
    added = cli(kvhome, "docs", "add", str(path), "--n-ctx", "4096")
    assert "valves.txt:" in added.stdout and "kept in the library" in added.stdout
    (entry,) = docs_list(cli, kvhome)
    assert entry["name"] == "valves.txt" and entry["kind"] == "text"
    assert entry["conversations"] == 0 and entry["file"] is None
    (reading,) = entry["readings"]
    assert reading["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and reading["kv_type"] == "f16"
    assert reading["on_disk"] and entry["kv_bytes"] == reading["kv_bytes"] > 0

    block = f'<document name="valves.txt" kind="text">\n{manual(SMALL)}\n</document>'
    wanted = chatml_tokens(block, QUESTION)
    shared = common_prefix(chatml_tokens(block, "a"), wanted)
    assert entry["tokens"] == shared > 350

    baseline_home = copy_home(kvhome, "baseline")
    report = cli(kvhome, "ask", "--new", "--doc", "valves.txt", QUESTION, *FLAGS).json
    baseline = cli(
        baseline_home, "ask", "--new", "-a", str(path), QUESTION, "--no-restore", *FLAGS
    ).json
    assert report["restore"]["from"] == "disk"
    assert report["restore"]["tokens"] == report["tokens"]["reused"] == shared
    assert report["tokens"]["prompt"] == len(wanted)
    assert report["tokens"]["decoded"] == len(wanted) - shared < 24
    assert baseline["tokens"]["reused"] == 0
    assert report["reply"] == baseline["reply"] and report["tokens"]["generated"] > 0
    assert docs_list(cli, kvhome)[0]["conversations"] == 1

    # Another KV type is another read, said before it starts; both readings are listed.
    again = cli(kvhome, "docs", "add", str(path), "--n-ctx", "4096", "--kv-type", "q8_0")
    assert "was read with SmolLM2-135M-Instruct.Q4_1.gguf (f16 KV)" in again.stderr
    assert "another read" in again.stderr
    (entry,) = docs_list(cli, kvhome)
    assert sorted(r["kv_type"] for r in entry["readings"]) == ["f16", "q8_0"]

    # A budget of nothing evicts every snapshot but the library's readings.
    no_room = {"KVCHAT_DISK_CACHE_GIB": "0"}
    gc = cli(kvhome, "cache", "gc", env=no_room)
    assert "evicted 1 snapshots" in gc.stdout  # the conversation's own
    (entry,) = docs_list(cli, kvhome)
    assert all(r["on_disk"] for r in entry["readings"])

    # The file changes: the library keeps the text it read, and says so; a new add reads
    # the new version in place of the old one.
    path.write_text(manual(SMALL) + "\nItem 41: a new valve.\n")
    listed = cli(kvhome, "docs", "list").stdout
    assert "changed on disk" in listed and "reads the new version" in listed
    newer = cli(kvhome, "docs", "add", str(path), "--n-ctx", "4096").stdout
    assert "kept in the library in place of the earlier version" in newer
    (entry,) = docs_list(cli, kvhome)
    assert entry["file"] is None and entry["tokens"] > shared
    assert [r["kv_type"] for r in entry["readings"]] == ["f16"]

    removed = cli(kvhome, "docs", "rm", "valves.txt")
    assert "removed valves.txt from the library" in removed.stdout
    assert docs_list(cli, kvhome) == []
    gc = cli(kvhome, "cache", "gc", env=no_room)
    assert "evicted 3 snapshots" in gc.stdout  # the three readings, none pinned now
    assert cli(kvhome, "cache", "--json").json["disk"]["snapshots"] == 0
    missing = cli(kvhome, "ask", "--new", "--doc", "valves.txt", QUESTION, *FLAGS, check=False)
    assert missing.returncode == 2 and "no document 'valves.txt' in the library" in missing.stderr
