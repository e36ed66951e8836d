"""Which llama-servers run on this machine under ``kvchat server start``, and where they keep
their slot files, so that a kvchat on the same machine can read those files itself.

The supervisor writes one small JSON file per port into the user cache directory (beside
the binary, and like it shared by every kvchat home of the user); it removes it when it
stops. A client trusts an entry only when its supervisor still runs, the URL it talks to
is an address of this machine on that port, and the server reports the entry's model.

A llama-server started by hand on this machine (the README's "if you run llama-server
yourself", with the ``--slot-save-path`` that ``kvchat server`` prints) is found too, on
Linux: the process of this user listening on the URL's port, and the ``--slot-save-path`` of
its command line (:func:`listening_slot_dir`). Whatever is found is only a candidate: the
first save checks that the file the server says it wrote is there, of that size.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import platformdirs


@dataclass(frozen=True)
class LocalServer:
    """A supervised llama-server on this machine."""

    port: int
    slot_dir: str
    model_path: str
    pid: int  # the supervisor's
    url: str
    server_pid: int = 0  # the llama-server it runs now


def registry_dir() -> Path:
    return platformdirs.user_cache_path("kvchat") / "servers"


def entry_path(port: int) -> Path:
    return registry_dir() / f"port-{port}.json"


def register(server: LocalServer) -> Path:
    """Record ``server`` (atomically: a temporary name, then rename); returns the file."""
    path = entry_path(server.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(asdict(server), sort_keys=True))
    os.replace(partial, path)
    return path


def unregister(server: LocalServer) -> None:
    """Remove the entry if it is still this supervisor's."""
    found = _read(entry_path(server.port))
    if found is not None and found.pid == server.pid:
        entry_path(server.port).unlink(missing_ok=True)


def local_server(url: str, model_path: str) -> LocalServer | None:
    """The supervised server behind ``url``, if it runs on this machine for this model."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not parts.hostname or not _is_this_machine(parts.hostname):
        return None
    found = _read(entry_path(port))
    if found is None or found.model_path != model_path or not _alive(found.pid):
        return None
    return found if Path(found.slot_dir).is_dir() else None


def _read(path: Path) -> LocalServer | None:
    """The entry at ``path``: a small regular file (never through a link, never blocking on a
    FIFO), or None for anything else, damaged included."""
    from kvchat.engine.probe_book import read_bounded

    raw = read_bounded(path, 65536)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return LocalServer(
            port=int(data["port"]),
            slot_dir=str(data["slot_dir"]),
            model_path=str(data["model_path"]),
            pid=int(data["pid"]),
            url=str(data["url"]),
            server_pid=int(data.get("server_pid") or 0),
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine (a local address can be bound)."""
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _type, _proto, _name, address in infos:
        ip = ipaddress.ip_address(address[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_SLOT_FLAG = "--slot-save-path"


def listening_slot_dir(url: str) -> Path | None:
    """The ``--slot-save-path`` of the process of this user that listens on ``url``'s port
    on this machine (Linux ``/proc``), when it is a directory; else None."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not parts.hostname or not _is_this_machine(parts.hostname):
        return None
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        found = _slot_dir_of(pid, inodes)
        if found is not None:
            return found
    return None


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (IPv4 and IPv6) in this network namespace."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii", errors="replace") as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != _LISTEN:
                        continue
                    _addr, _, hex_port = fields[1].rpartition(":")
                    if hex_port and int(hex_port, 16) == port:
                        inodes.add(fields[9])
        except (OSError, ValueError):
            continue
    return inodes


def _slot_dir_of(pid: str, inodes: set[str]) -> Path | None:
    """Process ``pid``'s ``--slot-save-path`` if it holds one of ``inodes`` (else None)."""
    base = Path("/proc") / pid
    try:
        args = (base / "cmdline").read_bytes()[: 1 << 20].split(b"\0")
    except OSError:
        return None
    value: bytes | None = None
    for index, arg in enumerate(args):
        if arg == _SLOT_FLAG.encode() and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(_SLOT_FLAG.encode() + b"="):
            value = arg.split(b"=", 1)[1]
    if not value:
        return None
    try:
        fds = os.listdir(base / "fd")
        cwd = os.readlink(base / "cwd")
    except OSError:  # another user's process: not ours to look into
        return None
    targets = set()
    for fd in fds:
        try:
            targets.add(os.readlink(base / "fd" / fd))
        except OSError:  # closed meanwhile
            continue
    if not any(f"socket:[{inode}]" in targets for inode in inodes):
        return None
    path = Path(cwd) / os.fsdecode(value)
    return path if path.is_dir() else None
