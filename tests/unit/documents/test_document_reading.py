"""A file a user names is read once, bounded and without blocking, or refused in one line
that names it: missing, too big, not a file, unreadable, changed while it was read."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from kvchat.documents import ReadBounds, attach, read_document
from kvchat.documents.document import Kind
from kvchat.errors import DocumentError


def refusal(path: Path, **kwargs: object) -> str:
    started = time.monotonic()
    with pytest.raises(DocumentError) as caught:
        attach(path, **kwargs)  # type: ignore[arg-type]
    assert time.monotonic() - started < 10  # never blocks
    line = str(caught.value)
    assert "\n" not in line and "Traceback" not in line
    return line


def test_a_text_file_becomes_a_document_with_its_size_hash_and_kind(tmp_path: Path) -> None:
    raw = b"# Notes\n\nread once, ask forever\n"
    (tmp_path / "notes.md").write_bytes(raw)
    (document,) = attach(tmp_path / "notes.md").documents
    assert document.name == "notes.md" and document.size == len(raw)
    assert document.sha256 == hashlib.sha256(raw).hexdigest()
    assert document.kind is Kind.MARKDOWN and document.pages is None
    assert document.text == raw.decode()


def test_a_missing_path_is_one_line(tmp_path: Path) -> None:
    assert refusal(tmp_path / "nope.txt").endswith("nope.txt: no such file or folder")


def test_a_two_gigabyte_file_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.log"
    with open(path, "wb") as f:
        os.truncate(f.fileno(), 2 << 30)  # sparse: no disk used
    assert refusal(path).endswith("huge.log: is 2.0 GiB; the limit is 32.0 MiB")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    assert refusal(path).endswith("pipe.txt: is a FIFO, not a file")


def test_a_device_is_refused(tmp_path: Path) -> None:
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert refusal(tmp_path / "zero").endswith("zero: is a device, not a file")


def test_a_glob_on_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    assert "a glob picks files of a folder only" in refusal(tmp_path / "a.txt", glob="*.md")


def test_a_link_loop_named_by_the_user_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert refusal(tmp_path / "loop").endswith("loop: is a link loop")


def unreadable_file(tmp_path: Path) -> Path:
    """A file this process may not read: mode 000, or for root (whom modes do not stop) a
    write-only sysctl, which the kernel refuses to read even to root."""
    if os.geteuid() != 0:
        path = tmp_path / "secret.txt"
        path.write_text("x")
        path.chmod(0)
        return path
    return Path("/proc/sys/vm/compact_memory")


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    path = unreadable_file(tmp_path)
    assert refusal(path).endswith(f"{path.name}: permission denied")


def test_a_file_whose_size_lies_is_changed_while_reading() -> None:
    """/proc files say 0 bytes and give more: what kvchat read is not what it measured."""
    line = refusal(Path("/proc/self/status"))
    assert "status: changed while reading (0 bytes at the start" in line


def test_a_file_growing_while_it_is_read_is_refused_as_changed(tmp_path: Path) -> None:
    path = tmp_path / "growing.log"
    path.write_bytes(b"line\n" * (2 << 20))
    stop = threading.Event()

    def append() -> None:
        with open(path, "ab", buffering=0) as f:
            while not stop.is_set():
                f.write(b"more\n")

    writer = threading.Thread(target=append)
    writer.start()
    try:
        lines = []
        for _ in range(5):
            try:
                read_document(path, bounds=ReadBounds(max_text_chars=1 << 30))
            except DocumentError as exc:
                lines.append(str(exc))
    finally:
        stop.set()
        writer.join()
    assert lines and all("growing.log: changed while reading" in line for line in lines)
