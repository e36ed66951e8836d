"""The branch view: forks and edits are shown in the sidebar
under the session they were made from, and Space folds and unfolds them."""

from __future__ import annotations

from pathlib import Path

from kvchat.service.chat import ChatService
from kvchat.tui.main import MainScreen
from kvchat.tui.main.context import REFRESH_SESSIONS
from tests.e2e.tui.test_tui import SIZE, make_app, make_settings, ready, wait_until
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)


def sidebar_lines(main: MainScreen) -> list[str]:
    """The sidebar's lines as drawn on screen, top to bottom."""
    sessions = main.sessions
    height = sessions.scrollable_content_region.height
    return [sessions.render_line(y).text.strip() for y in range(height)]


def titles(main: MainScreen) -> list[str]:
    """The sidebar's title lines, top to bottom, as shown (not its date headers, not the
    lines of figures under each title)."""
    return [
        line
        for line in sidebar_lines(main)
        if line and " tok · " not in line and line not in ("Today", "Yesterday")
    ]


async def test_the_sidebar_shows_forks_under_their_parent_and_folds_them(kvhome: Path) -> None:
    service = ChatService(make_settings())
    alpha = service.sessions.new_session("Alpha")
    service.sessions.add_message(alpha.id, "user", "alpha question")
    service.sessions.add_message(alpha.id, "assistant", "alpha answer")
    beta = service.sessions.new_session("Beta")
    service.sessions.add_message(beta.id, "user", "beta question")
    fork = service.sessions.fork(alpha.id)  # the newest: listed first were it not Alpha's branch
    service.sessions.remember_open(beta.id)
    service.close()

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        assert main.session_id == beta.id
        await wait_until(lambda: len(main.sessions.rows) == 3)
        # Roots by last update; the fork right under its parent, indented.
        assert [r.id for r in main.sessions.rows] == [beta.id, alpha.id, fork.id]
        await wait_until(lambda: titles(main) == ["Beta", "▾ Alpha", "└ Fork at #2: Alpha"])

        await pilot.press("ctrl+l")
        main.sessions.index = 1  # Alpha
        await pilot.press("space")
        await wait_until(lambda: [r.id for r in main.sessions.rows] == [beta.id, alpha.id])
        await wait_until(lambda: titles(main) == ["Beta", "▸ +1 Alpha"])  # says what it hides
        assert main.sessions.index == 1

        await pilot.press("space")
        await wait_until(lambda: [r.id for r in main.sessions.rows] == [beta.id, alpha.id, fork.id])
        assert titles(main) == ["Beta", "▾ Alpha", "└ Fork at #2: Alpha"]

        # Space on the branch folds its parent's branches too; opening a folded branch
        # (here as a search jump would) unfolds its ancestors: it stays visible.
        main.sessions.index = 2
        await pilot.press("space")
        await wait_until(lambda: [r.id for r in main.sessions.rows] == [beta.id, alpha.id])
        main.open_session(fork.id)
        await wait_until(lambda: main.session_id == fork.id)
        main.run_job(REFRESH_SESSIONS, main.refresh_sessions)
        await wait_until(lambda: [r.id for r in main.sessions.rows][-1:] == [fork.id])
        assert main.sessions.rows[main.sessions.index or 0].id == fork.id
