"""Everything kvchat asks of the operating system, chosen once by the OS it runs on.

``posix`` on Linux and macOS; ``portable`` elsewhere (Windows). ``KVCHAT_PLATFORM=portable``
(or :func:`use`) forces one, so the Linux test suite runs the portable implementation too.
"""

from __future__ import annotations

import os

from kvchat.errors import KvchatError
from kvchat.system.api import CpuInfo, HeldLock, Listener, LockBusy, ProcessUsage, System

PLATFORM_ENV = "KVCHAT_PLATFORM"
NAMES = ("posix", "portable")

_chosen: System | None = None


def _native() -> str:
    return "posix" if os.name == "posix" else "portable"


def _make(name: str) -> System:
    if name == "posix":
        from kvchat.system.posix import PosixSystem

        return PosixSystem()
    from kvchat.system.portable import PortableSystem

    return PortableSystem()


def use(name: str | None) -> System:
    """Use implementation ``name`` from now on (None: the one for this OS, or the
    environment's ``KVCHAT_PLATFORM``); returns it. Raises KvchatError for another name or
    for ``posix`` where the OS lacks its calls."""
    global _chosen
    wanted = name or os.environ.get(PLATFORM_ENV, "").strip() or _native()
    if wanted not in NAMES:
        raise KvchatError(f"{PLATFORM_ENV}={wanted!r} is not one of {', '.join(NAMES)}")
    if wanted == "posix" and os.name != "posix":
        raise KvchatError(f"{PLATFORM_ENV}=posix needs a POSIX system, not {os.name}")
    _chosen = _make(wanted)
    return _chosen


def current() -> System:
    """The implementation in use (chosen on first call)."""
    return _chosen if _chosen is not None else use(None)


__all__ = [
    "NAMES",
    "PLATFORM_ENV",
    "CpuInfo",
    "HeldLock",
    "Listener",
    "LockBusy",
    "ProcessUsage",
    "System",
    "current",
    "use",
]
