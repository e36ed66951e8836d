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

from kvchat.errors import KvchatError
from kvchat.system import Listener
from kvchat.system import current as current_system


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
    from kvchat.engine.openai_wire import loads
    from kvchat.engine.probe_book import read_bounded

    raw = read_bounded(path, 65536)
    if raw is None:
        return None
    try:
        data = loads(raw, "a server registry entry", cap=65536)
        return LocalServer(
            port=int(data["port"]),
            slot_dir=str(data["slot_dir"]),
            model_path=str(data["model_path"]),
            pid=int(data["pid"]),
            url=str(data["url"]),
            server_pid=int(data.get("server_pid") or 0),
        )
    except (KvchatError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    return current_system().pid_alive(pid)


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


_SLOT_FLAG = "--slot-save-path"


def listening_slot_dir(url: str) -> Path | None:
    """The ``--slot-save-path`` of the process of this user that listens on ``url``'s port
    on this machine (where the OS says which process listens), when it is a directory;
    else None."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not parts.hostname or not _is_this_machine(parts.hostname):
        return None
    for listener in current_system().listeners(port):
        found = _slot_dir_of(listener)
        if found is not None:
            return found
    return None


def _slot_dir_of(listener: Listener) -> Path | None:
    """The listener's ``--slot-save-path`` when it names a directory (else None)."""
    value: bytes | None = None
    for index, arg in enumerate(listener.argv):
        if arg == _SLOT_FLAG.encode() and index + 1 < len(listener.argv):
            value = listener.argv[index + 1]
        elif arg.startswith(_SLOT_FLAG.encode() + b"="):
            value = arg.split(b"=", 1)[1]
    if not value:
        return None
    path = Path(listener.cwd) / os.fsdecode(value)
    return path if path.is_dir() else None
