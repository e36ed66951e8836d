"""kvchat.system's guarantees, proved against both implementations on this machine: the
POSIX one and the portable one written for Windows (forced with ``kvchat.system.use``)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat import system
from kvchat.errors import KvchatError
from kvchat.system import LockBusy, System


@pytest.fixture(params=system.NAMES)
def os_calls(request: pytest.FixtureRequest) -> Iterator[System]:
    """Each implementation in turn; the one for this OS again afterwards."""
    yield system.use(request.param)
    system.use(None)


def test_the_implementation_is_forced_by_name_and_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert system.use("portable").name == "portable"
    monkeypatch.setenv(system.PLATFORM_ENV, "portable")
    assert system.use(None).name == "portable" and system.current().name == "portable"
    monkeypatch.setenv(system.PLATFORM_ENV, "windows95")
    with pytest.raises(KvchatError, match="is not one of posix, portable"):
        system.use(None)
    monkeypatch.delenv(system.PLATFORM_ENV)
    assert system.use(None).name == ("posix" if os.name == "posix" else "portable")


def test_a_link_is_never_opened_for_reading(os_calls: System, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("secret")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as excinfo:
        os_calls.open_no_follow(tmp_path / "link", os.O_RDONLY)
    assert excinfo.value.errno == errno.ELOOP


def test_a_write_through_a_link_neither_truncates_nor_writes_its_target(
    os_calls: System, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.write_text("keep me")
    (tmp_path / "link").symlink_to(target)
    for flags in (os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDWR):
        with pytest.raises(OSError) as excinfo:
            os_calls.open_no_follow(tmp_path / "link", flags)
        assert excinfo.value.errno == errno.ELOOP
    with pytest.raises(OSError):  # a dangling link is not created through either
        (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
        os_calls.open_no_follow(tmp_path / "dangling", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert target.read_text() == "keep me" and not (tmp_path / "nowhere").exists()


def test_a_regular_file_opens_created_private_and_truncated_on_request(
    os_calls: System, tmp_path: Path
) -> None:
    path = tmp_path / "file"
    fd = os_calls.open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.write(fd, b"0123456789")
    os.close(fd)
    assert path.stat().st_mode & 0o777 == 0o600
    fd = os_calls.open_no_follow(path, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert path.read_bytes() == b""


def test_a_directory_link_is_not_fsynced_through(os_calls: System, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    os_calls.fsync_dir(real)
    with pytest.raises(OSError):
        os_calls.fsync_dir(tmp_path / "link")


def test_a_held_lock_keeps_others_out_and_names_its_holder(
    os_calls: System, tmp_path: Path
) -> None:
    path = tmp_path / "a.lock"
    outcome: list[str] = []

    def other() -> None:
        try:
            with os_calls.hold_lock(path, wait_s=0.2):
                outcome.append("got it")
        except LockBusy as busy:
            outcome.append(f"busy: {busy.holder}")

    with os_calls.hold_lock(path, wait_s=0) as held:
        held.note("process 4242")
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
    assert outcome == ["busy: process 4242"]
    thread = threading.Thread(target=other)  # and free once let go
    thread.start()
    thread.join(30)
    assert outcome[-1] == "got it"
    os_calls.remove_lock(path)
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_that_is_a_link_is_refused(os_calls: System, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("not a lock")
    (tmp_path / "a.lock").symlink_to(target)
    with pytest.raises(OSError):
        with os_calls.hold_lock(tmp_path / "a.lock", wait_s=0):
            pass
    assert target.read_text() == "not a lock"


def test_process_checks_tell_the_living_from_the_impossible(os_calls: System) -> None:
    assert os_calls.pid_alive(os.getpid())
    assert os_calls.pid_alive(os.getppid())
    for impossible in (0, -1, 2**22 + 1, 2**70):
        assert not os_calls.pid_alive(impossible)


def test_reads_fill_buffers_in_order_and_stop_short_at_the_end(
    os_calls: System, tmp_path: Path
) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 4)
    fd = os_calls.open_no_follow(path, os.O_RDONLY)
    try:
        first, second = bytearray(10), bytearray(2000)
        got = os_calls.read_into(fd, [memoryview(first), memoryview(second)], 1000)
        assert got == 24 and bytes(first) == bytes(range(232, 242))
        assert bytes(second[:14]) == bytes(range(242, 256))
        mapping = os_calls.map_read_only(fd, 1024)
        assert mapping[:4] == bytes([0, 1, 2, 3]) and len(mapping) == 1024
        mapping.close()
    finally:
        os.close(fd)


def test_the_clipboard_command_is_one_that_is_installed(os_calls: System, tmp_path: Path) -> None:
    assert os_calls.clipboard_command({"PATH": str(tmp_path)}) is None
    tool = tmp_path / "pbcopy"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o700)
    assert os_calls.clipboard_command({"PATH": str(tmp_path)}) == (str(tool),)


def test_what_the_os_cannot_say_is_unknown_not_guessed(os_calls: System) -> None:
    cpu = os_calls.cpu()
    ram = os_calls.available_ram()
    usage = os_calls.process_usage(os.getpid())
    if os_calls.name == "portable" and os.name == "posix":
        assert not cpu.flags and cpu.physical_cores == 0 and ram is None and usage is None
        assert os_calls.listeners(1) == []
    else:
        assert ram is None or ram > 0
        assert usage is None or usage.rss_bytes > 0
