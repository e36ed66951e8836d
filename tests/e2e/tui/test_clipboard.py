"""Copying reaches the user's clipboard: OSC 52 without tmux (or when tmux passes it), a
clipboard tool under tmux with an external clipboard, else a private file, and the app
says where a copy went. Clipboard tools run as processes; the model is the stand-in of
the snapshot tests."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvchat.tui.clipboard import CopyRoute, choose_route, clipboard_command, deliver
from tests.unit.tui.test_keys_and_copy import notices, service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from


def _fake_bin(tmp_path: Path, **scripts: str) -> Path:
    """A folder of shell scripts standing in for tmux and clipboard tools."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = folder / name.replace("_", "-")
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return folder


def test_clipboard_route_without_tmux_or_when_tmux_passes_osc52(tmp_path: Path) -> None:
    assert choose_route({"PATH": str(tmp_path)}) == CopyRoute(osc52=True)
    # Inside tmux, but no tmux command to ask: OSC 52, and no failure.
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(tmp_path / "none")}).osc52
    on = _fake_bin(tmp_path, tmux="echo on")
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(on)}).osc52
    broken = _fake_bin(tmp_path / "b", tmux="exit 1")
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(broken)}).osc52


def test_clipboard_falls_back_to_a_tool_under_tmux_external(tmp_path: Path) -> None:
    out = tmp_path / "clip.out"
    folder = _fake_bin(tmp_path, tmux="echo external", xclip=f'cat > "{out}"')
    env = {"TMUX": "/tmp/x,1,0", "PATH": str(folder), "DISPLAY": ":0"}
    route = choose_route(env)
    assert not route.osc52 and route.tmux_setting == "external"
    assert route.command == (str(folder / "xclip"), "-selection", "clipboard")
    outcome = deliver(route, "fn main() {}\n", tmp_path / "data")
    assert outcome.how == "command" and outcome.where == "xclip"
    assert out.read_text() == "fn main() {}\n"
    assert "set -g set-clipboard on" in outcome.note
    # xclip needs a display; wl-copy a Wayland session; pbcopy nothing.
    assert clipboard_command({"PATH": str(folder)}) is None
    both = _fake_bin(tmp_path / "w", wl_copy="true", pbcopy="true")
    assert clipboard_command({"PATH": str(both), "WAYLAND_DISPLAY": "w-0"}) == (
        str(both / "wl-copy"),
    )
    assert clipboard_command({"PATH": str(both)}) == (str(both / "pbcopy"),)


def test_clipboard_falls_back_to_a_private_file(tmp_path: Path) -> None:
    folder = _fake_bin(tmp_path, tmux="echo off", pbcopy="exit 3")  # a tool that fails
    route = choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(folder)})
    assert route.command == (str(folder / "pbcopy"),)
    outcome = deliver(route, "secret code", tmp_path / "data")
    path = tmp_path / "data" / "clipboard.txt"
    assert outcome.how == "file" and outcome.where == str(path)
    assert path.read_text() == "secret code"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert str(path) in outcome.note and "set -g set-clipboard on" in outcome.note


async def test_copy_under_tmux_external_writes_the_file_and_says_where(
    service: StandInService, tmp_path: Path, kvhome: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _fake_bin(tmp_path, tmux="echo external")
    monkeypatch.setenv("TMUX", "/tmp/tmux-1/default,1,0")
    monkeypatch.setenv("PATH", str(folder))
    session = service.sessions.new_session("Code")
    service.store.add_message(session.id, "user", "a question", token_count=2)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        app.main.conversation.views[0].focus()
        await pilot.pause()
        await pilot.press("ctrl+o")
        path = kvhome / "clipboard.txt"
        await _wait(lambda: any(str(path) in n for n in notices(app)))
        assert path.read_text() == "a question"
        assert any("set -g set-clipboard on" in n for n in notices(app))
