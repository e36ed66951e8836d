"""Pilot tests of issue 11's TUI items: keys under tmux and copying there (9), message numbers,
search snippets and fast jumps (6), numbers that agree (7), dialogs and the exit status (8),
message details and widths (13), system prompt presets (14).

Pure-UI behaviour runs the real app over the real service and store with the deterministic
stand-in for the model from the snapshot tests; what is about turns runs the real model
(the last test).
"""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.content import Content
from textual.widgets import Input, Label, OptionList, Select, TextArea

from kvchat.config import Settings
from kvchat.limits import sampling_problem
from kvchat.service.chat import SnapshotWrite, TurnReport
from kvchat.store import Message, SearchHit
from kvchat.tui import app as app_module
from kvchat.tui.app import EXIT_FATAL, KvchatApp, run_app
from kvchat.tui.clipboard import CopyRoute, choose_route, clipboard_command, deliver
from kvchat.tui.keys import KEYS, bindings
from kvchat.tui.main import MainScreen
from kvchat.tui.palette import KvchatCommands
from kvchat.tui.phrases import saved_phrase, turn_lines
from kvchat.tui.screens.details import DetailsDialog
from kvchat.tui.screens.dialogs import ConfirmDialog, ExportDialog, SettingsDialog
from kvchat.tui.screens.error import ErrorScreen
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.screens.search import SearchScreen, hit_content
from kvchat.tui.widgets.conversation import SHOWN, MessageView
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.sidebar import row_lines
from tests.test_tui_branches import sidebar_lines
from tests.test_tui_snapshots import REPLY, StandInService, _settled, _wait

SIZE = (100, 30)
RUST = "Vec<String> and &[String]"


@pytest.fixture
def service(kvhome: Path, monkeypatch: pytest.MonkeyPatch) -> StandInService:
    # Copies go by OSC 52 unless a test puts the app under (a fake) tmux.
    for name in ("TMUX", "DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    return StandInService(Settings(n_ctx=8192, n_threads=1))


def start(service: StandInService, size: tuple[int, int] = SIZE) -> tuple[KvchatApp, Any]:
    app = KvchatApp(service.host.settings, service, cursor_blink=False)
    return app, app.run_test(size=size)


def header(view: MessageView) -> str:
    """The role line the message draws (its first line)."""
    return view.drawn_lines[0].strip()


def notices(app: KvchatApp) -> list[str]:
    return [n.message for n in app._notifications]


def add_pairs(service: StandInService, session_id: str, n: int, text: str = "line") -> None:
    for i in range(n):
        service.store.add_message(session_id, "user", f"{text} {2 * i}", token_count=3)
        service.store.add_message(session_id, "assistant", f"{text} {2 * i + 1}", token_count=4)


# --- item 9: keys under tmux ---------------------------------------------------------------


def _widget_keys(cls: type) -> set[str]:
    keys: set[str] = set()
    for klass in cls.__mro__:
        for binding in getattr(klass, "BINDINGS", []):
            key = binding.key if hasattr(binding, "key") else binding[0]
            keys |= {k.strip() for k in key.split(",")}
    return keys


def test_no_key_is_tmux_prefix_and_every_key_works_while_typing() -> None:
    app_keys = {k.strip() for b in bindings() for k in b.key.split(",")}
    assert "ctrl+b" not in app_keys  # tmux's prefix never reaches the app
    copy_code = next(k for k in KEYS if k.action == "copy_code")
    assert copy_code.keys == "f5"
    # The input (a TextArea) and the dialogs' Input take keys first: none may shadow an app key.
    for cls in (PromptInput, Input):
        assert not (app_keys - {"escape", "ctrl+q"}) & _widget_keys(cls), cls


async def test_f5_copies_a_code_block_while_typing(service: StandInService) -> None:
    session = service.sessions.new_session("Code")
    service.store.add_message(session.id, "user", "sort?", token_count=2)
    service.store.add_message(session.id, "assistant", REPLY, token_count=9)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        assert app.focused is app.main.prompt
        await pilot.press("f5")
        await _wait(lambda: app.clipboard.startswith("people = "))
        await _wait(lambda: any("Copied the code block" in n for n in notices(app)))


async def test_tab_stops_once_on_the_messages_and_arrows_move_between_them(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Six")
    add_pairs(service, session.id, 3)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        views = main.conversation.views
        assert len(views) == 6 and app.focused is main.prompt
        cycle = []
        for _ in range(12):
            await pilot.press("tab")
            cycle.append(app.focused)
            if app.focused is main.prompt:
                break
        assert cycle[-1] is main.prompt
        assert [w for w in cycle if isinstance(w, MessageView)] == [views[-1]]  # one stop
        assert len(cycle) == 3  # sessions, the messages, the input
        # Back to the messages, then ↑/↓ move between them.
        await pilot.press("shift+tab")
        assert app.focused is views[-1]
        await pilot.press("up", "up")
        assert app.focused is views[-3]
        await pilot.press("down")
        assert app.focused is views[-2]
        # The message last visited stays the tab stop.
        await pilot.press("tab", "shift+tab")
        assert app.focused is views[-2]
        await pilot.press("down", "down")  # past the last message: the input
        assert app.focused is main.prompt
        # A click focuses any message.
        await pilot.click(views[0])
        await pilot.pause()
        assert app.focused is views[0]


def _fake_bin(tmp_path: Path, **scripts: str) -> Path:
    """A folder of shell scripts standing in for tmux and clipboard tools."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = folder / name.replace("_", "-")
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return folder


@pytest.mark.e2e
def test_clipboard_route_without_tmux_or_when_tmux_passes_osc52(tmp_path: Path) -> None:
    assert choose_route({"PATH": str(tmp_path)}) == CopyRoute(osc52=True)
    # Inside tmux, but no tmux command to ask: OSC 52, and no failure.
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(tmp_path / "none")}).osc52
    on = _fake_bin(tmp_path, tmux="echo on")
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(on)}).osc52
    broken = _fake_bin(tmp_path / "b", tmux="exit 1")
    assert choose_route({"TMUX": "/tmp/x,1,0", "PATH": str(broken)}).osc52


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
        await pilot.press("c")
        path = kvhome / "clipboard.txt"
        await _wait(lambda: any(str(path) in n for n in notices(app)))
        assert path.read_text() == "a question"
        assert any("set -g set-clipboard on" in n for n in notices(app))


# --- item 6: finding things ------------------------------------------------------------------


async def test_messages_show_their_number_in_the_session(service: StandInService) -> None:
    session = service.sessions.new_session("Long")
    add_pairs(service, session.id, 35)  # 70 messages: the last SHOWN are shown
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        stored = service.sessions.messages(session.id)
        views = main.conversation.views
        first = 70 - SHOWN + 1
        assert views[0].number == first and header(views[0]) == f"You · #{first}"
        assert header(views[-1]) == "Assistant · #70"
        for view in views:  # the number is the 1-based position `kvchat fork --at` takes
            assert view.number is not None and stored[view.number - 1].id == view.message_id
        main.prompt.insert("Next")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        assert [header(v) for v in main.conversation.views[-2:]] == ["You · #71", "Assistant · #72"]


async def test_search_snippets_keep_square_brackets(service: StandInService) -> None:
    session = service.sessions.new_session("Rust")
    service.store.add_message(session.id, "user", f"What is {RUST}?", token_count=9)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+f")
        await _wait(lambda: isinstance(app.screen, SearchScreen))
        search = app.screen
        assert isinstance(search, SearchScreen)
        # The store marks matches with "[" and "]": brackets in the text must survive that.
        await pilot.press(*"what")
        await _wait(lambda: len(search.hits) == 1)
        await pilot.pause()
        prompt = search.query_one("#hits", OptionList).get_option_at_index(0).prompt
        assert isinstance(prompt, Content)
        assert prompt.plain.endswith(f"What is {RUST}?"), prompt.plain
        marked = [prompt.plain[s.start : s.end] for s in prompt.spans if "reverse" in str(s.style)]
        assert marked == ["What"]


def test_search_snippets_with_control_markers() -> None:
    message = Message(1, "s", "user", f"What is {RUST}?", "2025-01-01T00:00:00+00:00", 9, False)
    hit = SearchHit(message, "Rust", "…is Vec<\x02String\x03> and &[\x02String\x03]?")
    content = hit_content(hit, "string")
    assert content.plain.endswith("…is Vec<String> and &[String]?")
    marked = [content.plain[s.start : s.end] for s in content.spans if "reverse" in str(s.style)]
    assert marked == ["String", "String"]


def _frames(app: KvchatApp, main: MainScreen, hit_text: str) -> list[tuple[int, bool, float]]:
    """Record every frame drawn from now on: (messages mounted, the hit shown, when).

    The hit is shown when its view is in the conversation's viewport with its Markdown
    rendered (not a note that it is being drawn in parts).
    """
    frames: list[tuple[int, bool, float]] = []
    display = app._display

    def spy(screen: Any, renderable: Any) -> None:
        if renderable is not None and not app._batch_count and screen is main:
            # What is drawn: a page that a show replaced is hidden until it is removed.
            views = [v for v in main.conversation.query(MessageView) if v.parent.display]
            hit = next((v for v in views if v.text == hit_text), None)
            area = main.conversation.region
            shown = hit is not None and area.y <= hit.region.y < area.bottom and hit.body.rendered
            frames.append((len(views), shown, time.perf_counter()))
        display(screen, renderable)

    app._display = spy  # type: ignore[method-assign]
    return frames


async def test_a_jump_to_an_old_hit_mounts_its_page_and_is_never_blank(
    service: StandInService,
) -> None:
    long = service.sessions.new_session("Long")
    for i in range(300):
        text = f"message {i} with **bold** text\n\n- one\n- two"
        if i == 4:
            text = "the zebra message"
        service.store.add_message(
            long.id, "user" if i % 2 == 0 else "assistant", text, token_count=5
        )
    other = service.sessions.new_session("Other")
    service.store.add_message(other.id, "user", "hello", token_count=1)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.session_id == other.id
        await pilot.press("ctrl+f")
        await _wait(lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"zebra")
        await _wait(lambda: len(getattr(app.screen, "hits", ())) == 1)
        frames = _frames(app, main, "the zebra message")
        started = time.perf_counter()
        await pilot.press("enter")
        await _wait(
            lambda: isinstance(app.focused, MessageView) and app.focused.text == "the zebra message"
        )
        settled = time.perf_counter() - started
        # The jump: from Enter on the hit to the first frame that shows it.
        shown_at = next(t for _, shown, t in frames if shown) - started
        print(
            f"\njump to message #5 of 300: hit on screen after {shown_at * 1000:,.0f} ms "
            f"(open_session {main.last_jump_ms or 0:,.0f} ms; all work done after "
            f"{settled * 1000:,.0f} ms)"
        )
        # Every frame shows the session searched from, or the hit: none blank or elsewhere.
        # The first with the hit has only the messages from it that fill the screen (and
        # the two before it); the rest of its window of 12 follow below, frames later.
        shapes = [(n, shown) for n, shown, _ in frames]
        assert shapes and all(shape == (1, False) or shape[1] for shape in shapes), shapes
        hits = [n for n, shown in shapes if shown]
        assert hits[0] < 12 and hits == sorted(hits), shapes
        await _wait(lambda: len(main.conversation.views) == 12)
        views = main.conversation.views
        assert len(views) <= 12 and views[0].number == 3 and app.focused.number == 5  # type: ignore[union-attr]
        later = main.conversation.query_one("#later", Label)
        assert "286 later messages not shown" in str(later.content)
        # ↓ past the last shown message shows the latest ones again.
        views[-1].focus()
        await pilot.pause()
        await pilot.press("down")
        await _wait(lambda: main.conversation.later == 0 and len(main.conversation.views) == SHOWN)
        assert main.conversation.views[-1].number == 300


# --- item 7: numbers that agree -------------------------------------------------------------


def _info(app: KvchatApp, session_id: str) -> tuple[str, str]:
    """A session's sidebar figure ("3,812 tok") and badge."""
    row = app.main.sessions.row(session_id)
    assert row is not None
    title, lines = row_lines(row)[0], sidebar_lines(app.main)
    # Its title line (cut with "…" in a narrow sidebar), then the line under it.
    at = next(
        i
        for i, line in enumerate(lines)
        if line == title or (line.endswith("…") and title.startswith(line[:-1]))
    )
    below = lines[at + 1]
    return below.split(" · ")[0], below.split()[-1]


async def test_sidebar_tokens_match_the_gauge_and_an_empty_session_is_not_hot(
    service: StandInService,
) -> None:
    session = service.sessions.new_session("Sort")
    service.store.add_message(session.id, "user", "How do I sort?", token_count=7)
    service.store.add_message(session.id, "assistant", "sorted()", token_count=5)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.status.used == 3812  # what the stand-in restored
        await _wait(lambda: _info(app, session.id)[0] == "3,812 tok")
        assert _info(app, session.id)[1] == "hot"
        await pilot.press("ctrl+n")
        await _wait(lambda: main.session_id != session.id and main.hot_id == main.session_id)
        await _settled(pilot)
        empty = main.session_id
        assert empty is not None and main.status.used == 0
        info, badge = _info(app, empty)
        assert info == "0 tok" and badge == "none"
        # The other session: no KV saved (the stand-in saves none), so its messages' count.
        assert _info(app, session.id)[0] == "12 tok"


class SavingStandIn(StandInService):
    """A stand-in whose turns report a large snapshot of which little was written."""

    def answer(self, session_id: str, message_id: int, **kwargs: Any) -> TurnReport:
        report = super().answer(session_id, message_id, **kwargs)
        report.restore.source = "none"
        report.snapshot = SnapshotWrite(bytes=80_000_000, written=1_048_576, ms=9)
        return report


async def test_the_status_shows_what_a_turn_wrote(kvhome: Path) -> None:
    service = SavingStandIn(Settings(n_ctx=8192, n_threads=1))
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.prompt.insert("Hi")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        assert main.status.memory_text == "KV: hot · wrote 1.0 MiB to disk in 9 ms"


def test_counts_have_thousands_separators() -> None:
    report = TurnReport(
        session_id="s",
        reply="r",
        tokens=__import__("kvchat.service.chat", fromlist=["TokenCounts"]).TokenCounts(
            4321, 4000, 321, 1234
        ),
        restore=__import__("kvchat.kvcache", fromlist=["RestoreResult"]).RestoreResult(
            "disk", ms=41, bytes=1, tokens=4000
        ),
        ttft_ms=1500,
        tokens_per_s=31.25,
        finish_reason="length",
        snapshot=SnapshotWrite(bytes=10, written=0, ms=3),
    )
    lines = turn_lines(report)
    assert "Generated: 1,234 tokens at 31.2 tok/s" in lines
    assert "Prompt: 4,321 tokens (4,000 reused, 321 decoded)" in lines
    assert "First token after: 1,500 ms" in lines
    assert "KV: restored 4,000 tokens from disk in 41 ms" in lines
    assert "Ended: stopped at the token limit" in lines
    assert saved_phrase(report) == "saved: nothing new to write to disk"


# --- item 8: dialogs and the exit status ----------------------------------------------------


async def test_export_defaults_to_the_data_dir_and_never_overwrites_silently(
    service: StandInService, kvhome: Path
) -> None:
    session = service.sessions.new_session("Travel")
    service.store.add_message(session.id, "user", "Where is the Eiffel tower?", token_count=7)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        path_input = app.screen.query_one("#path", Input)
        default = kvhome / "exports" / "travel.md"
        assert path_input.value == str(default)
        assert path_input.has_focus and path_input.selection.is_empty  # not select-all
        assert path_input.cursor_position == len(path_input.value)
        await pilot.press("enter")
        await _wait(lambda: default.exists())
        assert default.read_text().startswith("# Travel")
        assert stat.S_IMODE(default.stat().st_mode) == 0o600
        assert stat.S_IMODE(default.parent.stat().st_mode) == 0o700

        # Again: a free name by default.
        await _wait(lambda: app.screen is app.main)
        await pilot.press("ctrl+s")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        path_input = app.screen.query_one("#path", Input)
        assert path_input.value == str(kvhome / "exports" / "travel-2.md")
        # An existing file: asked first; "n" keeps it, "y" replaces it.
        default.write_text("keep me")
        path_input.value = str(default)
        await pilot.press("enter")
        await _wait(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("n")
        await _wait(lambda: isinstance(app.screen, ExportDialog))
        assert default.read_text() == "keep me"
        await pilot.press("enter")
        await _wait(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await _wait(lambda: default.read_text().startswith("# Travel"))
        assert not (kvhome / "exports" / "travel-2.md").exists()


async def test_settings_dialog_refuses_values_out_of_range(service: StandInService) -> None:
    session = service.sessions.new_session("Tuning")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        dialog = app.screen
        error = dialog.query_one("#settings-error", Label)
        fields = {
            k: dialog.query_one(f"#set-{k}", Input) for k in ("temperature", "top_p", "max_tokens")
        }
        cases = [
            ({"temperature": "120"}, "temperature must be from 0 to 2"),
            ({"temperature": "-1"}, "temperature must be from 0 to 2"),
            ({"temperature": "0.5", "top_p": "0"}, "top_p must be more than 0 and at most 1"),
            ({"top_p": "1.5"}, "top_p must be more than 0"),
            ({"top_p": "0.9", "max_tokens": "0"}, "max_tokens must be a whole number, at least 1"),
            ({"max_tokens": "9000"}, "at most the context length (8,192 tokens)"),
        ]
        for values, message in cases:
            for key, value in values.items():
                fields[key].value = value
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.screen is dialog, values
            assert message in str(error.content), (values, error.content)
            assert error.display
        fields["max_tokens"].value = "100"
        await pilot.press("ctrl+s")
        await _wait(lambda: app.screen is app.main)
        await _wait(lambda: service.sessions.resolve(session.id).settings != {})
        assert service.sessions.resolve(session.id).settings == {
            "temperature": 0.5,
            "top_p": 0.9,
            "max_tokens": 100,
        }


def test_limits_are_one_set_of_ranges() -> None:
    assert sampling_problem("temperature", 0) is None
    assert sampling_problem("temperature", 2) is None
    assert sampling_problem("temperature", 2.01) is not None
    assert sampling_problem("top_p", 1) is None and sampling_problem("top_p", 0) is not None
    assert sampling_problem("max_tokens", 1) is None
    assert sampling_problem("max_tokens", 4096, n_ctx=4096) is None
    assert sampling_problem("max_tokens", 4097, n_ctx=4096) is not None
    assert sampling_problem("seed", -1) is not None and sampling_problem("seed", 0) is None


async def test_the_app_exits_non_zero_after_its_error_screen(kvhome: Path, tmp_path: Path) -> None:
    settings = Settings(model=str(tmp_path / "missing.gguf"), n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        await _wait(lambda: isinstance(app.screen, ErrorScreen), 60)
        await pilot.pause()
        app.simulate_key("q")
        await _wait(lambda: app._closed, 30)
    assert app.return_code == EXIT_FATAL != 0


def test_run_app_exits_with_the_apps_status(monkeypatch: pytest.MonkeyPatch) -> None:
    class Finished:
        def __init__(self, settings: Settings) -> None:
            self.return_code: int | None = None

        def run(self) -> None:
            self.return_code = code

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(app_module, "KvchatApp", Finished)
    code = EXIT_FATAL
    with pytest.raises(SystemExit) as exited:
        run_app(Settings(n_threads=1))
    assert exited.value.code == EXIT_FATAL
    code = 0
    assert run_app(Settings(n_threads=1)) == 0


# --- item 13: message details, widths -------------------------------------------------------


async def test_message_details_on_demand(service: StandInService) -> None:
    session = service.sessions.new_session("Figures")
    service.store.add_message(session.id, "user", "Earlier question", token_count=4)
    service.store.add_message(session.id, "assistant", "Earlier answer", token_count=6)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        main.conversation.views[1].focus()
        await pilot.pause()
        await pilot.press("i")  # a reply from before this run: its time and tokens
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert text.startswith("Message #2 · Assistant") and "Tokens: 6" in text
        assert "Time: " in text and "kept for the replies generated since" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)

        main.prompt.focus()
        main.prompt.insert("New question")
        await pilot.press("enter")
        await _wait(lambda: main.last_turn is not None and main.turn is None)
        await _settled(pilot)
        main.prompt.focus()
        await pilot.press("f3")  # no message selected: the last reply
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert text.startswith("Message #4 · Assistant"), text
        assert "Generated: 62 tokens at 31.0 tok/s" in text
        assert "Prompt: 3,837 tokens (3,812 reused, 25 decoded)" in text
        assert "First token after: 48 ms" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)

    entries = {action for _, action, _ in KvchatCommands._entries(None)}  # type: ignore[arg-type]
    assert "message_details" in entries
    assert {b.key: b.action for b in MessageView.BINDINGS}["i"] == "details"  # type: ignore[union-attr]


async def test_help_lists_the_new_keys(service: StandInService) -> None:
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("f1")
        await _wait(lambda: isinstance(app.screen, HelpScreen))
        labels = {str(label.render()) for label in app.screen.query(".key-label")}
        assert {"F3", "F5", "↑ / ↓ (on a message)", "c / b / i (on a message)"} <= labels
        assert "Ctrl+B" not in labels


@pytest.mark.parametrize(("width", "sidebar"), [(80, 28), (100, 28), (160, 40), (240, 44)])
async def test_sidebar_widens_and_messages_keep_a_readable_width(
    service: StandInService, width: int, sidebar: int
) -> None:
    session = service.sessions.new_session("A title long enough to be cut on a narrow terminal")
    service.store.add_message(session.id, "user", "word " * 200, token_count=200)
    app, run = start(service, (width, 30))
    async with run as pilot:
        await _settled(pilot)
        assert app.main.sessions.outer_size.width == sidebar
        assert app.main.conversation.views[0].outer_size.width <= 100


# --- item 14: system prompt presets ---------------------------------------------------------


async def test_settings_offer_system_prompt_presets_from_the_config_file(kvhome: Path) -> None:
    kvhome.mkdir(parents=True, exist_ok=True)
    (kvhome / "config.toml").write_text(
        'temperature = 0.3\n\n[presets]\npirate = "Answer like a pirate."\nbad = 3\n'
    )
    service = StandInService(Settings(n_ctx=8192, n_threads=1))  # the table is no setting
    assert service.host.settings.temperature == 0.3
    session = service.sessions.new_session("Ahoy")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        dialog = app.screen
        select = dialog.query_one("#preset", Select)
        names = [str(prompt) for prompt, _ in select._options if _ is not Select.NULL]
        assert {"Concise", "Programmer", "pirate"} <= set(names) and "bad" not in names
        assert any("not text were skipped: bad" in n for n in notices(app))
        select.value = "pirate"
        await pilot.pause()
        assert dialog.query_one("#system-prompt", TextArea).text == "Answer like a pirate."
        await pilot.press("ctrl+s")
        await _wait(
            lambda: service.sessions.resolve(session.id).system_prompt == "Answer like a pirate."
        )
        await _wait(lambda: app.screen is app.main)
        await pilot.press("ctrl+g")  # the preset in use is shown as picked
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#preset", Select).value == "pirate"


# --- with the real model: the figures of real turns -----------------------------------------


@pytest.fixture
def no_tmux(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TMUX", raising=False)
    yield


@pytest.mark.e2e
async def test_real_turns_numbers_details_and_figures_agree(kvhome: Path, no_tmux: None) -> None:
    settings = Settings(temperature=0, max_tokens=12, n_ctx=2048, n_threads=1)
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _wait(lambda: main.ready, 120)
        for text in ("Name a color.", "Name a fruit."):
            main.prompt.insert(text)
            before = main.last_turn
            await pilot.press("enter")
            await _wait(lambda b=before: main.last_turn is not b and main.turn is None, 120)
            await _wait(lambda: main.housekeeping_idle, 120)  # the settle and the save
        await _settled(pilot)
        report = main.last_report
        assert report is not None and report.snapshot.written > 0
        # The last reply, when cut at max_tokens, says so and how to go on (issue 11.4); an
        # earlier one cut says so too, from its stored finish reason (issue 22.4).
        first = app.service.sessions.messages(main.session_id)[1]  # type: ignore[union-attr,arg-type]
        cut = " · stopped at the token limit"
        assert [header(v) for v in main.conversation.views] == [
            "You · #1",
            "Assistant · #2" + (cut if first.finish_reason == "length" else ""),
            "You · #3",
            "Assistant · #4"
            + (f"{cut} (F12 continues)" if report.finish_reason == "length" else ""),
        ]
        # The memory line says what the turn wrote (a few chunks), not the snapshot's size.
        assert main.status.memory_text.startswith("KV: hot · wrote ")
        assert report.snapshot.written <= report.snapshot.bytes
        # One figure for the open session in the sidebar and the gauge.
        session_id = main.session_id
        assert session_id is not None
        await _wait(lambda: _info(app, session_id)[0] == f"{main.status.used:,} tok")
        assert main.status.used > 0 and _info(app, session_id)[1] == "hot"
        main.prompt.focus()
        await pilot.press("f3")
        await _wait(lambda: isinstance(app.screen, DetailsDialog))
        text = app.screen.text  # type: ignore[attr-defined]
        assert f"Generated: {report.tokens.generated:,} tokens at " in text
        assert f"({report.tokens.reused:,} reused, {report.tokens.decoded:,} decoded)" in text
        await pilot.press("escape")
        await _wait(lambda: app.screen is main)
        # Away from it, the session keeps that figure (its saved KV's), and a new empty
        # session is not badged hot.
        used = main.status.used
        await pilot.press("ctrl+n")
        await _wait(lambda: main.session_id != session_id and main.hot_id == main.session_id)
        await _settled(pilot)
        await _wait(lambda: _info(app, session_id)[0] == f"{used:,} tok")
        assert main.session_id is not None and _info(app, main.session_id)[1] == "none"
        app.simulate_key("ctrl+q")
        await _wait(lambda: app._closed, 60)
    assert app.return_code == 0
