"""Copying text out of the app, also under tmux.

Textual copies with OSC 52 (the terminal puts the text on the clipboard). tmux drops
OSC 52 from applications unless its ``set-clipboard`` option is ``on``; its default,
``external``, drops it silently. So under tmux with ``external`` or ``off`` the text goes to
a clipboard command when one is installed (``wl-copy``, ``xclip``, ``pbcopy``), else to a
private file in the data directory, and the notice says where it went and how to let
tmux pass OSC 52 on. Nothing here needs tmux to be installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvchat.system import current as current_system

# tmux's set-clipboard values that keep an application's OSC 52 from the terminal.
BLOCKING = frozenset({"external", "off"})
ENABLE_HINT = "add `set -g set-clipboard on` to ~/.tmux.conf to copy straight from kvchat"
FALLBACK_FILE = "clipboard.txt"

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class CopyRoute:
    """How a copy reaches the clipboard: by OSC 52, else a command, else a file."""

    osc52: bool
    command: tuple[str, ...] | None = None
    tmux_setting: str | None = None  # tmux's set-clipboard, when it blocks OSC 52


@dataclass(frozen=True)
class CopyOutcome:
    """Where the text went: "terminal" (OSC 52), "command" (its name) or "file" (its path)."""

    how: str
    where: str | None
    note: str  # what to tell the user besides "copied" ("" when nothing)


def tmux_set_clipboard(env: Mapping[str, str], run: Runner = subprocess.run) -> str | None:
    """tmux's ``set-clipboard`` when running inside tmux (``$TMUX``), else None.

    None also when the ``tmux`` command is missing or does not answer.
    """
    if not env.get("TMUX"):
        return None
    tmux = shutil.which("tmux", path=env.get("PATH"))
    if tmux is None:
        return None
    try:
        done = run(
            [tmux, "show", "-gv", "set-clipboard"],
            capture_output=True,
            text=True,
            timeout=2,
            env=dict(env),
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    value = done.stdout.strip() if done.returncode == 0 else ""
    return value or None


def clipboard_command(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """A clipboard command that is installed and usable here, or None (``kvchat.system``
    knows which: ``wl-copy`` with Wayland, ``xclip`` with X, ``pbcopy``; ``clip`` on
    Windows)."""
    return current_system().clipboard_command(env)


def choose_route(env: Mapping[str, str] | None = None, run: Runner = subprocess.run) -> CopyRoute:
    """OSC 52 unless tmux is known to drop it; then a clipboard command if there is one."""
    env = os.environ if env is None else env
    setting = tmux_set_clipboard(env, run)
    if setting not in BLOCKING:
        return CopyRoute(osc52=True)
    return CopyRoute(osc52=False, command=clipboard_command(env), tmux_setting=setting)


def deliver(route: CopyRoute, text: str, directory: Path) -> CopyOutcome:
    """Put ``text`` where ``route`` says (the caller sends OSC 52 itself, in every case).

    A failing command falls back to the file ``directory/clipboard.txt`` (0600).
    """
    if route.osc52:
        return CopyOutcome("terminal", None, "")
    why = f"tmux drops terminal copies (its set-clipboard is {route.tmux_setting})"
    if route.command is not None:
        name = Path(route.command[0]).name
        try:
            subprocess.run(
                route.command,
                input=text.encode("utf-8"),
                stdout=subprocess.DEVNULL,  # xclip stays in the background holding the text
                stderr=subprocess.DEVNULL,
                timeout=5,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            pass
        else:
            return CopyOutcome("command", name, f"with {name}: {why}; {ENABLE_HINT}")
    path = write_private(directory / FALLBACK_FILE, text)
    tools = ", ".join(current_system().clipboard_tools)
    return CopyOutcome(
        "file",
        str(path),
        f"to {path}: {why} and no clipboard tool ({tools}) worked; {ENABLE_HINT}",
    )


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by the owner only, replacing it atomically.

    The rename replaces a symlink at ``path`` rather than writing through it.
    """
    from kvchat.paths import ensure_private_dir

    ensure_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
