"""A full disk never loses a reply that was generated: a full disk at snapshot time is
reported and the reply kept; a reply that cannot be stored is still returned and the CLI
prints it and says so; a reader that goes away does not lose the reply. Real model."""

from __future__ import annotations

import errno
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import Settings
from kvchat.kvcache.cold import files as kvfiles
from kvchat.service.chat import ChatService
from kvchat.store.store import Store, StoreFull
from tests.conftest import FAST, REPO, clean_env
from tests.e2e.text.test_text_stays_text import service

__all__ = ["service"]  # fixtures shared with the module they come from


# --- 2. a full disk --------------------------------------------------------------------------


def _full(kind: str) -> Exception:
    if kind == "store":
        return StoreFull(
            "the disk is full: could not write to kvchat.db (database or disk is full)"
        )
    if kind == "sqlite":
        return sqlite3.OperationalError("database or disk is full")
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("kind", ["store", "sqlite", "oserror"])
def test_a_full_disk_at_snapshot_time_is_reported_and_the_reply_kept(
    service: ChatService, monkeypatch: pytest.MonkeyPatch, kind: str
):
    session = service.sessions.new_session()

    def full(*_args, **_kwargs):
        raise _full(kind)

    if kind == "oserror":
        monkeypatch.setattr(kvfiles, "write_atomically", full)
    else:
        monkeypatch.setattr(service.store, "put_snapshot", full)
    report = service.send(session.id, "Name a colour.")
    assert report.reply.strip() and report.message_id is not None
    assert report.snapshot.error and report.snapshot.error.startswith("the disk is full"), (
        report.snapshot.error
    )
    assert [m.role for m in service.sessions.messages(session.id)] == ["user", "assistant"]
    monkeypatch.undo()
    assert service.send(session.id, "Another?").snapshot.error is None


def test_a_reply_that_cannot_be_stored_is_still_returned(
    service: ChatService, monkeypatch: pytest.MonkeyPatch
):
    session = service.sessions.new_session()
    add = service.store.add_message

    def full_for_replies(session_id, role, content, **kwargs):
        if role == "assistant":
            raise _full("store")
        return add(session_id, role, content, **kwargs)

    monkeypatch.setattr(service.store, "add_message", full_for_replies)
    report = service.send(session.id, "Name a colour.")
    assert report.reply.strip() and report.message_id is None
    assert report.reply_error and "could not be saved" in report.reply_error
    assert "the disk is full" in report.reply_error
    assert [m.role for m in service.sessions.messages(session.id)] == ["user"]


def test_the_cli_prints_a_reply_it_could_not_store_and_says_so(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    add = Store.add_message

    def full_for_replies(self, session_id, role, content, **kwargs):
        if role == "assistant":
            raise _full("store")
        return add(self, session_id, role, content, **kwargs)

    monkeypatch.setattr(Store, "add_message", full_for_replies)
    result = CliRunner().invoke(main, ["ask", "Name a colour.", *FAST])
    assert result.exit_code == 2, result.output
    assert result.stdout.strip()  # the reply
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: the reply could not be saved")
    assert "the disk is full" in lines[0] and "not stored" in lines[0]


def test_a_reader_that_goes_away_does_not_lose_the_reply(kvhome: Path):
    env = clean_env()
    env["KVCHAT_HOME"] = str(kvhome)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "ask", "Count to ten.", *FAST],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.read(1)
    proc.stdout.close()  # like `| head -c 1`
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.wait(300) == 0 and "Traceback" not in stderr, stderr
    service = ChatService(Settings())
    try:
        (summary,) = service.sessions.list_sessions()
        assert summary.messages == 2
    finally:
        service.close()
