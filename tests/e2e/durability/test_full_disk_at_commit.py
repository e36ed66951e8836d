"""A full disk when a streamed reply is committed: what kvchat says is
what the database holds. Real model, real SQLite; the full disk is SQLite's error."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvchat.service.chat
from kvchat.cli import main
from kvchat.store import Store
from kvchat.store.store import StoreFull
from tests.conftest import FAST


def test_a_reply_the_full_disk_cut_is_reported_as_stored(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    real_update = Store.update_message

    def full_at_the_end(self, message_id, content, partial, **kwargs):
        if not partial:  # the final commit: the disk filled up while the reply streamed
            raise StoreFull(
                "the disk is full: could not write to kvchat.db (database or disk is full)"
            )
        return real_update(self, message_id, content, partial, **kwargs)

    monkeypatch.setattr(kvchat.service.chat, "STREAM_SAVE_EVERY_S", 0.0)  # saved as it streams
    monkeypatch.setattr(Store, "update_message", full_at_the_end)
    result = CliRunner().invoke(main, ["ask", "Name three colours.", *FAST])

    assert result.exit_code == 2, result.output
    reply = result.stdout.removesuffix("\n")  # the reply as generated, trailing lines too
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the disk is full" in lines[0], lines
    assert "not stored" not in lines[0]
    said = re.search(r"keeps its first ([\d,]+) of ([\d,]+) characters, marked partial", lines[0])
    assert said is not None, lines[0]
    kept, total = (int(x.replace(",", "")) for x in said.groups())

    db = sqlite3.connect(kvhome / "kvchat.db")
    rows = db.execute("SELECT role, content, partial FROM messages ORDER BY id").fetchall()
    assert rows[0][:2] == ("user", "Name three colours.")
    [(role, content, partial)] = rows[1:]
    assert (role, len(content), partial) == ("assistant", kept, 1)
    assert total == len(reply) and reply.startswith(content)
