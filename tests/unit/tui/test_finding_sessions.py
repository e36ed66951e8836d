"""Finding a session among many (issue 41, item 7): Shift+F2 from anywhere filters the
sessions list by title and #tag (the footer and F1 say so), Shift+F3 (and the palette) pins
a session so it comes first, tags are set in Ctrl+G. The real app and store with the
snapshot tests' stand-in for the model."""

from __future__ import annotations

from textual.keys import _character_to_key
from textual.pilot import Pilot
from textual.widgets import Input

from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.dialogs import SettingsDialog
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.widgets.footer import shown_keys
from kvchat.tui.widgets.sidebar import PINNED
from tests.unit.tui.test_keys_and_copy import notices, service, start
from tests.unit.tui.test_tui_snapshots import StandInService, _settled, _wait

__all__ = ["service"]  # fixtures shared with the module they come from

TITLES = ("Rust borrow checker", "Python packaging", "Groceries", "Rust macros", "Taxes 2026")


def _seed(service: StandInService) -> dict[str, str]:
    """Five sessions with a message each (the last one made is the newest); title → id."""
    ids = {}
    for title in TITLES:
        session = service.sessions.new_session(title)
        service.store.add_message(session.id, "user", f"about {title}", token_count=4)
        ids[title] = session.id
    return ids


async def _type(pilot: Pilot[None], text: str) -> None:
    await pilot.press(*[_character_to_key(c) for c in text])


def _titles(app: KvchatApp) -> list[str]:
    return [r.summary.session.title for r in app.main.sessions.rows]


def _headers(app: KvchatApp) -> list[str]:
    return [x.text for x in app.main.sessions._lines if x.kind == "header"]


async def test_shift_f2_filters_by_title_and_tag_from_the_input(service: StandInService) -> None:
    ids = _seed(service)
    service.sessions.tag(ids["Rust macros"], "#work #rust")
    service.sessions.tag(ids["Taxes 2026"], "home")
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert app.focused is main.prompt
        await pilot.press("f14")  # what a terminal sends for Shift+F2
        await _wait(lambda: app.focused is main.sessions)
        assert main.sessions.filter_text == ""
        line = "".join(seg.text for seg in main.sessions.render_line(0))
        assert line.rstrip() == " / ▏title or #tag · Esc"  # what the filter takes
        await _type(pilot, "rust")
        await pilot.pause()
        assert sorted(_titles(app)) == ["Rust borrow checker", "Rust macros"]
        await pilot.press("escape")  # clears the filter, stays on the list
        await pilot.pause()
        assert main.sessions.filter_text is None and len(_titles(app)) == 5
        await pilot.press("f14")
        await _type(pilot, "#wo")  # a tag's beginning, as typed
        await pilot.pause()
        assert _titles(app) == ["Rust macros"]
        await pilot.press("backspace", "backspace", "backspace")
        await _type(pilot, "#h")
        await pilot.pause()
        assert _titles(app) == ["Taxes 2026"]
        await pilot.press("enter")
        await _wait(lambda: main.session_id == ids["Taxes 2026"])
        # The list's rows show the tags.
        from kvchat.tui.widgets.sidebar import row_lines

        row = next(r for r in main.sessions._all if r.id == ids["Rust macros"])
        assert row_lines(row)[1].endswith("· #work #rust")
        assert main.prompt.text == ""  # nothing typed went to the input


async def test_the_filter_key_is_in_the_footer_and_the_help(service: StandInService) -> None:
    app, run = start(service, size=(120, 35))
    async with run as pilot:
        await _settled(pilot)
        shown = {action: key for key, action, _description, _enabled in shown_keys(app.main)}
        assert "filter_sessions" in shown
        binding = next(
            b
            for _n, b, _e, _t in app.main.active_bindings.values()
            if b.action == "filter_sessions"
        )
        assert binding.key_display == "⇧F2" and binding.description == "Find"
        await pilot.press("f1")
        await _wait(lambda: isinstance(app.screen, HelpScreen))
        text = " ".join(str(label.content) for label in app.screen.query(".key-action"))
        assert "filter the list by title or #tag" in text
        labels = [str(label.content) for label in app.screen.query(".key-label")]
        assert "Shift+F2" in labels and "Shift+F3" in labels
        # And each is in the command palette.
        from kvchat.tui.palette import KvchatCommands

        actions = {action for _t, action, _l in KvchatCommands._entries(None)}  # type: ignore[arg-type]
        assert {"filter_sessions", "pin_session", "copy_conversation"} <= actions


async def test_pinned_sessions_come_first_by_key_and_by_palette(service: StandInService) -> None:
    ids = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert _titles(app)[0] == "Taxes 2026" and PINNED not in _headers(app)
        # Pin the highlighted session of the list (not the open one).
        await pilot.press("ctrl+l")
        await _wait(lambda: app.focused is main.sessions)
        main.sessions.highlight(ids["Groceries"])
        await pilot.press("f15")  # Shift+F3
        await _wait(lambda: _titles(app)[0] == "Groceries")
        assert _headers(app)[0] == PINNED
        assert service.store.get_session(ids["Groceries"]).pinned
        assert any("Pinned “Groceries”" in n for n in notices(app))
        # The palette's entry pins the open session.
        main.prompt.focus()
        await app.run_action("pin_session", main)
        open_title = service.store.get_session(main.session_id).title
        await _wait(lambda: [r.summary.session.pinned for r in main.sessions.rows][:3] == [1, 1, 0])
        assert set(_titles(app)[:2]) == {"Groceries", open_title}
        assert _headers(app)[:2] == [PINNED, "Today"]
        # Unpinned again (the open one: the input has focus), it goes back under Today.
        await pilot.press("f15")
        await _wait(lambda: not service.store.get_session(main.session_id).pinned)
        await _wait(
            lambda: [r.summary.session.pinned for r in main.sessions.rows][:2] == [True, False]
        )
        assert _titles(app)[:2] == ["Groceries", open_title]
        assert _headers(app) == [PINNED, "Today"]


async def test_tags_are_set_in_ctrl_g_and_a_bad_tag_keeps_the_dialog(
    service: StandInService,
) -> None:
    ids = _seed(service)
    app, run = start(service)
    async with run as pilot:
        await _settled(pilot)
        main = app.main
        assert main.session_id == ids["Taxes 2026"]
        await pilot.press("ctrl+g")
        await _wait(lambda: isinstance(app.screen, SettingsDialog))
        dialog = app.screen
        tags = dialog.query_one("#tags", Input)
        tags.value = "#home a/b"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is dialog  # refused, kept open with the reason
        assert "a/b is not a tag" in str(dialog.query_one("#settings-error").content)
        tags.value = "#Home, money"
        await pilot.press("ctrl+s")
        await _wait(lambda: app.screen is main)
        await _wait(lambda: service.store.get_session(ids["Taxes 2026"]).tags == ("home", "money"))
        await pilot.press("f14")
        await _type(pilot, "#mon")
        await pilot.pause()
        assert _titles(app) == ["Taxes 2026"]
