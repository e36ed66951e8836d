"""OS and SQLite errors are one line: start-up housekeeping on a full disk is no error, the
CLI turns OS and SQLite errors into one line, and a database that cannot open on a full
disk says the disk is full. Model-free, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.kvcache.cold.snapshot_store import SnapshotStore
from kvchat.service.chat import ChatService
from kvchat.store.store import Store
from tests.e2e.durability.test_full_disk import _full


def test_startup_housekeeping_on_a_full_disk_is_no_error(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    def full(self):
        raise _full("store")

    monkeypatch.setattr(SnapshotStore, "cleanup_orphans", full)
    service = ChatService(Settings())
    try:
        assert service.sessions.list_sessions() == []
    finally:
        service.close()


def test_the_cli_turns_os_and_sqlite_errors_into_one_line(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    ChatService(Settings()).close()  # a database to read (`list` makes none)
    for error in (_full("oserror"), _full("sqlite")):

        def broken(self, *args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(Store, "list_sessions", broken)
        monkeypatch.setattr(
            Store, "list_sessions_page", broken
        )  # what `list` reads a page at a time
        result = CliRunner().invoke(main, ["list"])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvchat: the disk is full"), lines


def test_a_database_that_cannot_open_on_a_full_disk_says_the_disk_is_full(
    kvhome: Path, monkeypatch: pytest.MonkeyPatch
):
    import kvchat.service.checks

    ChatService(Settings()).close()  # the home exists

    def io_error(self, path, **_kwargs):
        raise KvchatError(f"database error in {path}: disk I/O error")

    monkeypatch.setattr(Store, "__init__", io_error)
    monkeypatch.setattr(kvchat.service.checks, "disk_full", lambda _directory: True)
    for args in (["list"], ["cache"], ["export", "x"], ["ask", "Hi"], ["doctor"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "the disk" in lines[0] and "is full" in lines[0], lines
    assert (kvhome / "kvchat.db").exists()  # doctor moved nothing aside
