"""The boundary with the model hub: what ``kvchat models pull`` takes from the network and
writes to disk.

- **The token stays with the hub.** The download follows redirects itself (at most
  :data:`MAX_REDIRECTS`, http and https only, never https down to http), and a redirect to
  another origin (scheme, host, port) drops ``Authorization`` and ``Cookie``: the CDN a
  resolve URL sends to never sees the Hugging Face token. (The metadata calls go through
  ``huggingface_hub``'s own HTTP client, which drops ``Authorization`` on a redirect to
  another host too.)
- **Time is bounded.** The answer's headers, across every redirect, must arrive within
  :data:`HEADERS_S` (a watchdog shuts the sockets); then no byte for :data:`STALL_S` or less
  than :data:`MIN_RATE` bytes a second over :data:`RATE_WINDOW_S` cuts the download off.
  What arrived stays in the ``.partial`` file and the same pull goes on from there.
- **Bytes are bounded.** A server never writes more than the published size, and a resumed
  answer must start where the file stopped (``Content-Range``).
- **The ``.partial`` file is kvchat's own or nothing.** Something else at its path (a link,
  a FIFO, a device, a file with other links or another owner) is refused before anything is
  downloaded; the file is created with ``O_CREAT | O_EXCL`` and appended to, never through a
  link (``kvchat.system``'s no-follow open), so no write ever goes through a link.
- **What the hub publishes is checked**: a sha256 is 64 hex digits, a size a positive whole
  number; anything else counts as not published.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import stat
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvchat.errors import KvchatError
from kvchat.system import current as current_system
from kvchat.text import one_line

HEADERS_S = 60.0
STALL_S = 30.0
RATE_WINDOW_S = 30.0
MIN_RATE = 16 * 1024
MAX_REDIRECTS = 5
READ_CHUNK = 1 << 20
HASH_CHUNK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_SECRET_HEADERS = ("Authorization", "Cookie", "Proxy-authorization")


# --------------------------------------------------------------------------- what the hub says


@dataclass(frozen=True)
class Published:
    """The file's sha256 and size as the hub publishes them; ``problem`` says why either is
    missing."""

    sha256: str | None
    size: int | None
    problem: str | None = None


def _sha(item: Any) -> str | None:
    lfs = getattr(item, "lfs", None)
    if lfs is None:
        return None
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return sha.lower() if isinstance(sha, str) and _SHA256.fullmatch(sha.lower()) else None


def _size(item: Any) -> int | None:
    size = getattr(item, "size", None)
    return size if type(size) is int and 0 < size < 1 << 62 else None


def published(hub: Any, repo: str, filename: str) -> Published:
    """What the hub publishes about ``repo``/``filename``; never raises."""
    api = hub.HfApi()
    problem = "the repo publishes no sha256 for it"
    try:
        for item in api.get_paths_info(repo, [filename]):
            if getattr(item, "path", filename) == filename and _sha(item):
                return Published(_sha(item), _size(item))
    except Exception as exc:  # older hub, offline, gated, a hub answering junk
        problem = f"the hub's API failed ({_short(exc)})"
    try:
        info = api.model_info(repo, files_metadata=True)
        for sibling in getattr(info, "siblings", None) or []:
            if getattr(sibling, "rfilename", None) == filename:
                sha = _sha(sibling)
                return Published(sha, _size(sibling), None if sha else problem)
    except Exception as exc:
        return Published(None, None, f"the hub's API failed ({_short(exc)})")
    return Published(None, None, problem)


def _short(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}")[:160]


# --------------------------------------------------------------------------- the .partial file


def partial_size(partial: Path) -> int:
    """Bytes a stopped download left at ``partial`` (0: none). Anything there but kvchat's
    own regular file is refused, before anything is downloaded."""
    try:
        st = os.lstat(partial)
    except FileNotFoundError:
        return 0
    _own(partial, st)
    return st.st_size


def _own(partial: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        what = "a link"
    elif not stat.S_ISREG(st.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
    elif st.st_nlink != 1:
        what = "a file with other names (hard links)"
    elif not current_system().owned_by_me(st):
        what = "another user's file"
    else:
        return
    raise KvchatError(
        f"{partial} is {what}, not a download kvchat left there: nothing was downloaded "
        "(remove it and pull again)"
    )


def open_partial(partial: Path, resume: bool) -> int:
    """A descriptor to write ``partial`` with: appended to (``resume``) or new; never
    through a link, never a FIFO or device."""
    system = current_system()
    try:
        if resume:
            fd = system.open_no_follow(partial, os.O_WRONLY | os.O_APPEND, nonblocking=True)
        else:
            if partial_size(partial) or os.path.lexists(partial):
                os.unlink(partial)  # our own regular file (partial_size checked)
            new = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            fd = system.open_no_follow(partial, new, nonblocking=True)
    except OSError as exc:
        raise KvchatError(f"cannot write {partial}: {exc.strerror or exc}") from None
    try:
        _own(partial, os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sha256_of(partial: Path, progress: Callable[[int], None] = lambda _n: None) -> str:
    """The sha256 of kvchat's own ``partial`` file (never read through a link)."""
    digest = hashlib.sha256()
    fd = current_system().open_no_follow(partial, os.O_RDONLY, nonblocking=True)
    try:
        _own(partial, os.fstat(fd))
        while chunk := os.read(fd, HASH_CHUNK):
            digest.update(chunk)
            progress(len(chunk))
    finally:
        os.close(fd)
    return digest.hexdigest()


def remove_partial(partial: Path) -> None:
    """Remove ``partial`` if it is kvchat's own regular file (a link is left alone)."""
    try:
        _own(partial, os.lstat(partial))
    except (OSError, KvchatError):
        return
    partial.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the transfer


def same_origin(a: str, b: str) -> bool:
    one, two = urlsplit(a), urlsplit(b)
    ports = {"http": 80, "https": 443}
    return (one.scheme, one.hostname, one.port or ports.get(one.scheme)) == (
        two.scheme,
        two.hostname,
        two.port or ports.get(two.scheme),
    )


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS
    max_repeats = 2

    def redirect_request(  # type: ignore[override]
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        old_scheme, scheme = urlsplit(req.full_url).scheme, urlsplit(new.full_url).scheme
        if scheme not in ("http", "https") or (old_scheme == "https" and scheme == "http"):
            raise urllib.error.URLError(f"refused a redirect to {one_line(newurl)[:120]}")
        if not same_origin(req.full_url, new.full_url):
            for name in _SECRET_HEADERS:
                new.remove_header(name)
        return new


class _Watch:
    """The sockets of one download; :meth:`expire` shuts them (a watchdog's deadline)."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.expired = False
        self.lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.socks:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _opener(watch: _Watch) -> urllib.request.OpenerDirector:
    class Plain(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            watch.add(self.sock)

    class Secure(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            watch.add(self.sock)

    class PlainHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(Plain, req)

    class SecureHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(Secure, req, context=getattr(self, "_context", None))

    return urllib.request.build_opener(PlainHandler, SecureHandler, _Redirects)


def download(
    url: str,
    headers: dict[str, str],
    partial: Path,
    size: int | None,
    label: str,
    progress: Callable[[int], None] = lambda _n: None,
    room: int | None = None,
) -> None:
    """Download ``url`` into ``partial``, going on from what a stopped download left there
    (an HTTP Range request). ``size``: the published size (no more is written); ``room``:
    bytes the disk may take when the size is not known. A failure says how much is here and
    that the same pull resumes."""
    have = partial_size(partial)
    if size and have == size:
        return
    if size and have > size:  # not a start of this file: kvchat's own leftover, dropped
        remove_partial(partial)
        have = 0
    wanted = dict(headers)
    if have:
        wanted["Range"] = f"bytes={have}-"
    watch = _Watch()
    timer = threading.Timer(HEADERS_S, watch.expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            resp = _opener(watch).open(urllib.request.Request(url, headers=wanted), timeout=STALL_S)
        finally:
            timer.cancel()
        if watch.expired:  # the sockets were shut mid-headers: what came is not an answer
            resp.close()
            raise TimeoutError
        with resp:
            have = _resumed_at(resp, have, label)
            limit = (size - have) if size else (room if room is not None else None)
            fd = open_partial(partial, resume=bool(have))
            with os.fdopen(fd, "wb") as fh:
                progress(have)
                _copy(resp, fh, limit, label, progress)
                fh.flush()
                os.fsync(fh.fileno())
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        why = f"no answer within {HEADERS_S:.0f} s" if watch.expired else _reason(exc)
        raise _stopped(label, partial, why) from None
    if size and partial_size(partial) != size:
        raise KvchatError(
            f"download of {label} ended short ({partial_size(partial)} of {size} bytes): "
            "run the same pull again to go on from there"
        )


def _resumed_at(resp: Any, have: int, label: str) -> int:
    """Where the answer starts: ``have`` for a 206 that says so, 0 for a whole file."""
    if not have or resp.status != 206:
        return 0  # the server sends the whole file again
    match = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
    if match is None or int(match[1]) != have:
        raise KvchatError(
            f"download of {label}: the server answered a resume at byte {have} with "
            f"{one_line(resp.headers.get('Content-Range', 'no Content-Range'))[:80]!r}: "
            "nothing was written"
        )
    return have


def _copy(
    resp: Any, fh: Any, limit: int | None, label: str, progress: Callable[[int], None]
) -> None:
    """The body into ``fh``: at most ``limit`` bytes, at least :data:`MIN_RATE` a second."""
    written = 0
    mark_at, mark_bytes = time.monotonic(), 0
    while chunk := resp.read1(READ_CHUNK):
        written += len(chunk)
        if limit is not None and written > limit:
            raise KvchatError(
                f"download of {label}: the server sent more than the {limit} bytes expected; "
                "the extra was not written (run the same pull again)"
            )
        fh.write(chunk)
        progress(len(chunk))
        now = time.monotonic()
        if now - mark_at >= RATE_WINDOW_S:
            rate = (written - mark_bytes) / (now - mark_at)
            if rate < MIN_RATE:
                raise OSError(
                    f"too slow: {rate:.0f} B/s over the last {now - mark_at:.0f} s, "
                    f"under the {MIN_RATE // 1024} KiB/s floor"
                )
            mark_at, mark_bytes = now, written


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no byte for {STALL_S:.0f} s"
    return one_line(str(getattr(exc, "reason", None) or exc))[:160]


def _stopped(label: str, partial: Path, why: str) -> KvchatError:
    try:
        here = partial_size(partial)
    except KvchatError:
        here = 0
    return KvchatError(
        f"download of {label} stopped ({why}); {here} bytes are here: "
        "run the same pull again to go on from there"
    )


__all__ = [
    "HEADERS_S",
    "MIN_RATE",
    "RATE_WINDOW_S",
    "STALL_S",
    "Published",
    "download",
    "open_partial",
    "partial_size",
    "published",
    "remove_partial",
    "same_origin",
    "sha256_of",
]
