"""A llama-server kvchat did not start: the README's "if you run
llama-server yourself" path, against a real llama-server on this machine.

On 49ed7f8 a hand-started server's slot directory was never read: a bit-flipped slot file
was restored and the reply was wrong; a cut one aborted the server
(``GGML_ASSERT(nread <= state_size)``) and the turn said the server could not be reached.
Now kvchat finds the directory of a llama-server of this user listening on the URL's port
(or takes ``server_slot_dir``) and checks each file before a restore; where it cannot read
the directory (``server_slot_dir = "none"``, as for a remote server) it checks every
restore's KV by the next-token log-probabilities it gives. Each damaged turn must reply
exactly as a full prefill of the same conversation does, and the server must stay up.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server.test_server import Server, ask

pytestmark = pytest.mark.e2e

# Repacked weights crash llama.cpp on some CPUs (Intel AMX); slot files are what this is
# about, so the server runs without them everywhere.
SERVER_FLAGS = ("--no-repack",)
REMOTE = {"KVCHAT_SERVER_SLOT_DIR": "none"}


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A one-slot llama-server started by hand (as `kvchat server` prints it)."""
    running = Server(tmp_path_factory.mktemp("by-hand") / "slots", slots=1, extra=SERVER_FLAGS)
    yield running
    running.stop()


def _row(home: Path, session: str) -> dict[str, Any]:
    conn = sqlite3.connect(home / "kvchat.db")
    conn.row_factory = sqlite3.Row
    try:
        found = conn.execute("SELECT * FROM server_slots WHERE session_id=?", (session,))
        return dict(found.fetchone())
    finally:
        conn.close()


def _flip(path: Path) -> None:
    """One bit: the top exponent bit of an f16 KV value in the middle of the file."""
    data = bytearray(path.read_bytes())
    data[(len(data) // 2) | 1] ^= 0x40
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


FIRST = "Hi, I am Ann. I have a cat named Tom."
SECOND = "What is my name?"


def _full_prefill_reply(server: Server, home: Path) -> str:
    """The second turn's reply when nothing is restored (a twin conversation)."""
    session = ask(home, server.url, "--new", FIRST).json["session"]
    return str(ask(home, server.url, "--session", session, SECOND, "--no-restore").json["reply"])


def _damaged_turn(
    server: Server, tmp_path: Path, damage: str, env: dict[str, str]
) -> tuple[dict[str, Any], str]:
    """A first turn, its slot file damaged, a second turn restoring it: its report, and the
    reply a full prefill gives to the same second turn."""
    assert server.proc is not None
    pid = server.proc.pid
    home = tmp_path / "home"
    session = ask(home, server.url, "--new", FIRST, **env).json["session"]
    row = _row(home, session)
    path = server.plan.slot_dir / row["filename"]
    (_flip if damage == "bit_flip" else _cut)(path)
    report = ask(home, server.url, "--session", session, SECOND, **env).json
    # The server never went down: the same process, still serving.
    assert server.proc is not None and server.proc.poll() is None and server.proc.pid == pid
    return report, _full_prefill_reply(server, tmp_path / "twin")


@pytest.mark.parametrize("damage", ["bit_flip", "cut"])
def test_a_damaged_file_on_a_hand_started_server_here_is_never_restored(
    by_hand: Server, tmp_path: Path, damage: str
) -> None:
    """The directory is found (the server's --slot-save-path): checksummed, checked."""
    report, full = _damaged_turn(by_hand, tmp_path, damage, {})
    assert report["restore"]["from"] == "none", report["restore"]
    reason = report["restore"]["reason"]
    assert "damaged" in reason and "deleted" in reason and "full prefill" in reason, reason
    assert report["reply"] == full
    assert report["tokens"]["reused"] == 0


def test_the_slot_dir_setting_vouches_for_a_hand_started_server(
    by_hand: Server, tmp_path: Path
) -> None:
    env = {"KVCHAT_SERVER_SLOT_DIR": str(by_hand.plan.slot_dir)}
    report, full = _damaged_turn(by_hand, tmp_path, "bit_flip", env)
    assert report["restore"]["from"] == "none", report["restore"]
    assert "damaged" in report["restore"]["reason"], report["restore"]
    assert report["reply"] == full


def test_where_the_directory_is_not_readable_a_restore_is_checked_by_its_kv(
    by_hand: Server, tmp_path: Path
) -> None:
    """``server_slot_dir = "none"`` (a remote server): an intact file restores and replies
    as a full prefill does; a bit-flipped one is caught by the KV check."""
    home = tmp_path / "intact"
    session = ask(home, by_hand.url, "--new", FIRST, **REMOTE).json["session"]
    row = _row(home, session)
    assert row["checksum"] is None and row["kv_check"]
    intact = ask(home, by_hand.url, "--session", session, SECOND, **REMOTE).json
    full = _full_prefill_reply(by_hand, tmp_path / "twin0")
    assert intact["restore"]["from"] == "server", intact["restore"]
    assert intact["reply"] == full

    report, full = _damaged_turn(by_hand, tmp_path / "flipped", "bit_flip", REMOTE)
    assert report["restore"]["from"] == "none", report["restore"]
    reason = report["restore"]["reason"]
    assert "does not give the next-token figures" in reason and "full prefill" in reason, reason
    assert report["reply"] == full
