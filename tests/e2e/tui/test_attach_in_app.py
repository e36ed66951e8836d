"""Attachments in the terminal app, on the real app and the real model (SmolLM2-135M).

The picker (Ctrl+\\) reads what was picked off the UI thread and shows the fit line before
anything is stored; attached documents go with the next message: a new conversation's start
block, read once for all conversations (the second decodes only its question, counted by
llama.cpp), or with a message of a conversation under way. A path named in a message is
offered, never attached by itself: declined, the message is sent as typed. A file changed on
disk is never mixed in: a new conversation is offered. Bad input is one line, nothing stored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from textual import events
from textual.pilot import Pilot
from textual.widgets import DirectoryTree, Input

from kvchat.tui.app import KvchatApp
from kvchat.tui.main import MainScreen
from kvchat.tui.screens.attach import AttachScreen, OfferDialog
from kvchat.tui.screens.dialogs import ConfirmDialog
from tests.e2e.tui.test_tui import (
    SIZE,
    make_app,
    open_id,
    ready,
    send,
    service_of,
    wait_until,
)
from tests.e2e.tui.test_tui import (
    no_background_failures as no_background_failures,  # autouse here too
)

FIRST = "Which valve opens at the highest pressure?"
SECOND = "What colour is the valve in room 12?"
# Greedy, short replies; room for the document and a turn.
SETTINGS = {"max_tokens": 16, "n_ctx": 2048}


def manual(lines: int = 20, version: str = "") -> str:
    """A plain-text document of about 28 tokens a line."""
    colours = ("red", "blue", "green", "amber", "grey", "white", "black")
    return "\n".join(
        f"Item {i}{version}: the {colours[i % len(colours)]} valve in room {i * 7 % 101} opens "
        f"at {i * 13 % 97} kPa and closes after {i % 9 + 1} minutes."
        for i in range(1, lines + 1)
    )


@pytest.fixture
def docs(kvhome: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding one document, the working directory (where the picker starts)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "valves.txt").write_text(manual() + "\n")
    monkeypatch.chdir(folder)
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def open_picker(pilot: Pilot[None], app: KvchatApp) -> AttachScreen:
    await pilot.press("ctrl+backslash")
    await wait_until(lambda: isinstance(app.screen, AttachScreen))
    screen = app.screen
    assert isinstance(screen, AttachScreen)
    await pilot.pause()
    return screen


async def pick_file(pilot: Pilot[None], screen: AttachScreen, name: str = "valves.txt") -> None:
    """In the tree: the cursor on the file ``name`` (by its line), Enter reads it."""
    await select_in_tree(pilot, screen, name)
    await wait_until(lambda: screen.reading is not None or "-error" in _message_classes(screen))


async def select_in_tree(pilot: Pilot[None], screen: AttachScreen, name: str) -> None:
    """In the tree: the cursor on the entry ``name`` (by its line), Enter."""
    tree = screen.query_one("#attach-tree", DirectoryTree)
    tree.focus()
    await wait_until(lambda: tree.last_line >= 1)

    def line_of_name() -> int | None:
        for line in range(tree.last_line + 1):
            node = tree.get_node_at_line(line)
            if node is not None and node.data is not None and node.data.path.name == name:
                return line
        return None

    await wait_until(lambda: line_of_name() is not None)
    line = line_of_name()
    assert line is not None
    tree.cursor_line = line
    await pilot.press("enter")


def _message_classes(screen: AttachScreen) -> set[str]:
    return set(screen.query_one("#attach-message").classes)


async def attach_via_picker(pilot: Pilot[None], app: KvchatApp, main: MainScreen) -> str:
    """Ctrl+\\, the first file, Attach: the fit line the picker showed."""
    screen = await open_picker(pilot, app)
    await pick_file(pilot, screen)
    assert screen.reading is not None, screen.message
    line = screen.message
    await pilot.press("enter")  # the Attach button has focus once read
    await wait_until(lambda: app.screen is main and main.state.pending_documents is not None)
    await wait_until(lambda: any("valves.txt" in line for line in main.documents.lines))
    return line


async def type_and_enter(pilot: Pilot[None], main: MainScreen, text: str) -> None:
    main.prompt.focus()
    main.prompt.insert(text)
    await pilot.press("enter")


async def test_a_picked_file_shows_its_fit_goes_with_the_message_and_is_read_once(
    docs: Path,
) -> None:
    app = make_app(**SETTINGS)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)
        line = await attach_via_picker(pilot, app, main)
        assert "valves.txt: " in line and " tokens, " in line and "% of the context (2,048)" in line
        assert "read once for all conversations about them" in line and "attach?" in line
        assert service.store.documents() == []  # shown and attached: nothing stored yet
        assert any("not stored yet" in x for x in main.documents.lines)

        await send(pilot, main, FIRST)
        first_id = open_id(main)
        (used,) = service.documents.of_session(first_id)
        assert used.message_id is None  # a conversation's start block
        assert used.document.name == "valves.txt"
        assert used.document.sha256 == sha256(docs / "valves.txt")
        assert used.document.text == manual() + "\n"
        first = main.last_report
        assert first is not None and first.restore.source == "none"
        assert first.tokens.decoded == first.tokens.prompt > 500
        (reported,) = first.documents
        assert reported.name == "valves.txt" and reported.tokens > 500
        await wait_until(lambda: any("at start" in x for x in main.documents.lines))
        shown = main.documents.lines
        assert main.state.pending_documents is None
        assert f"valves.txt · text · 1.5 KB · {reported.tokens:,} tokens · at start" in shown
        assert len(manual()) + 1 == 1_577  # 1.5 KB
        assert any("read once for all conversations started with them" in x for x in shown)

        await pilot.press("ctrl+n")
        await wait_until(lambda: main.session_id not in (None, first_id))
        await attach_via_picker(pilot, app, main)
        await send(pilot, main, SECOND)
        second_id = open_id(main)
        assert second_id != first_id
        second = main.last_report
        assert second is not None
        engine = service.host.token_engine()
        head = service.turns.head(service.sessions.resolve(second_id))
        shared = service.documents.shared_end(engine, head)
        wanted = engine.chat_tokens([*head, {"role": "user", "content": SECOND}])
        assert second.tokens.prompt == len(wanted)
        assert second.tokens.reused == shared > 500
        assert second.tokens.decoded == len(wanted) - shared < 24
        assert second.tokens.generated > 0
        await wait_until(lambda: any("last turn:" in x for x in main.documents.lines))
        turn = next(x for x in main.documents.lines if x.startswith("last turn:"))
        assert turn.startswith(
            f"last turn: {second.tokens.reused:,} tokens reused, {second.tokens.decoded:,} decoded"
        )
        # One stored document, used by both conversations.
        assert [d.name for d in service.store.documents()] == ["valves.txt"]
        assert [u.message_id for u in service.documents.of_session(second_id)] == [None]


async def test_a_path_in_the_message_is_offered_declined_or_accepted(docs: Path) -> None:
    path = docs / "valves.txt"
    app = make_app(**SETTINGS)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)

        # Esc on the offer: the message goes back to the input, nothing is sent.
        typed = f"Summarise {path} please"
        await type_and_enter(pilot, main, typed)
        await wait_until(lambda: isinstance(app.screen, OfferDialog))
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main and main.prompt.text == typed)
        assert main.session_id is None and main.state.pending_documents is None
        main.prompt.clear()

        # Declined: sent as typed, the path is text.
        before = main.last_turn
        await type_and_enter(pilot, main, typed)
        await wait_until(lambda: isinstance(app.screen, OfferDialog))
        await pilot.press(*"sat")  # letters typed on answer nothing
        await pilot.pause()
        assert isinstance(app.screen, OfferDialog)
        await pilot.press("tab", "enter")  # Send as typed
        await wait_until(lambda: main.last_turn is not before and main.turn is None, 90)
        await wait_until(lambda: main.housekeeping_idle, 90)
        session_id = open_id(main)
        messages = service.sessions.messages(session_id)
        assert [(m.role, m.content) for m in messages[:1]] == [("user", typed)]
        assert service.documents.of_session(session_id) == []
        assert service.store.documents() == []

        # Accepted: the picker reads it and shows the fit first; sent with this message.
        asked = f"What is in '{path}'?"
        before = main.last_turn
        await type_and_enter(pilot, main, asked)
        await wait_until(lambda: isinstance(app.screen, OfferDialog))
        await pilot.press("enter")  # Attach, focused
        await wait_until(lambda: isinstance(app.screen, AttachScreen))
        offered = app.screen
        assert isinstance(offered, AttachScreen)
        await wait_until(lambda: offered.reading is not None)
        assert "read once for this conversation" in offered.message
        assert service.store.documents() == []  # not before Attach
        await pilot.press("enter")
        await wait_until(lambda: main.last_turn is not before and main.turn is None, 90)
        await wait_until(lambda: main.housekeeping_idle, 90)
        messages = service.sessions.messages(session_id)
        assert messages[2].role == "user" and messages[2].content == asked  # text stays text
        (used,) = service.documents.of_session(session_id)
        assert used.message_id == messages[2].id and used.document.sha256 == sha256(path)
        report = main.last_report
        assert report is not None and [d.name for d in report.documents] == ["valves.txt"]
        assert main.last_turn is not None and main.last_turn.documents_at_start is False
        await wait_until(lambda: any("with message #3" in x for x in main.documents.lines))
        assert any("read once for this conversation" in x for x in main.documents.lines)

        # Pasted: a notice; Ctrl+\\ reads the pasted path at once; Enter then sends as is.
        (docs / "pumps.txt").write_text("Pump 1 runs at night.\n")
        pasted = f"And {docs / 'pumps.txt'}?"
        main.prompt.focus()
        app.post_message(events.Paste(pasted))  # as the terminal driver does
        await wait_until(lambda: main.prompt.text == pasted)
        await wait_until(lambda: any("pumps.txt: Ctrl+" in n.message for n in app._notifications))
        assert len(service.store.documents()) == 1  # valves.txt only: nothing attached by itself
        picker = await open_picker(pilot, app)
        await wait_until(lambda: picker.reading is not None)
        assert picker.reading is not None and picker.reading.names == "pumps.txt"
        await pilot.press("enter")
        await wait_until(lambda: main.state.pending_documents is not None)
        before = main.last_turn
        main.prompt.focus()
        await pilot.press("enter")  # no offer: the path is attached already
        await wait_until(lambda: main.last_turn is not before and main.turn is None, 90)
        await wait_until(lambda: main.housekeeping_idle, 90)
        messages = service.sessions.messages(session_id)
        assert messages[4].content == pasted
        later = [
            u for u in service.documents.of_session(session_id) if u.message_id == messages[4].id
        ]
        assert [u.document.name for u in later] == ["pumps.txt"]


async def test_a_changed_file_is_never_mixed_in_a_new_conversation_is_offered(
    docs: Path,
) -> None:
    path = docs / "valves.txt"
    old_sha = sha256(path)
    app = make_app(**SETTINGS)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)
        await attach_via_picker(pilot, app, main)
        await send(pilot, main, FIRST)
        first_id = open_id(main)
        path.write_text(manual(version="b") + "\n")
        new_sha = sha256(path)

        # Declined: nothing attached, the conversation unchanged.
        screen = await open_picker(pilot, app)
        await pick_file(pilot, screen)
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        question = app.screen
        assert isinstance(question, ConfirmDialog)
        assert "valves.txt changed on disk" in question.question
        await pilot.press("n")
        await wait_until(lambda: app.screen is main)
        await pilot.pause()
        assert main.state.pending_documents is None and main.session_id == first_id
        await wait_until(lambda: any("changed on disk" in x for x in main.documents.lines))
        (noted,) = [x for x in main.documents.lines if x.startswith("valves.txt")]
        assert noted.endswith(
            "at start · changed on disk: this conversation keeps the text it read"
        )
        assert [u.document.sha256 for u in service.documents.of_session(first_id)] == [old_sha]

        # Accepted: a new conversation, the new version at its start.
        screen = await open_picker(pilot, app)
        await pick_file(pilot, screen)
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await wait_until(
            lambda: main.session_id != first_id and main.state.pending_documents is not None
        )
        pending = main.state.pending_documents
        assert pending is not None and pending.at_start
        assert [r.sha256 for r in pending.documents.rows] == [new_sha]
        await send(pilot, main, SECOND)
        second_id = open_id(main)
        assert second_id != first_id
        (used,) = service.documents.of_session(second_id)
        assert used.message_id is None and used.document.sha256 == new_sha
        (kept,) = service.documents.of_session(first_id)
        assert kept.document.sha256 == old_sha and kept.document.text == manual() + "\n"


async def test_bad_inputs_are_one_line_a_folder_takes_a_glob_and_nothing_is_stored(
    docs: Path,
) -> None:
    (docs / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (docs / "huge.txt").write_text(manual(lines=400) + "\n")  # ~11,000 tokens: over 2,048
    notes = docs / "notes"
    notes.mkdir()
    for name in ("a.md", "b.md", "c.py"):
        (notes / name).write_text(f"{name}\n")
    many = docs / "many"
    many.mkdir()
    for i in range(1_001):
        (many / f"f{i:04}.txt").write_text("x\n")
    cases = {
        str(docs / "missing.txt"): "missing.txt",
        str(docs / "blob.bin"): "blob.bin",
        str(many): "many",
        str(docs / "huge.txt"): "context",
    }
    app = make_app(**SETTINGS)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)
        screen = await open_picker(pilot, app)
        field = screen.query_one("#attach-path", Input)
        for path, named in cases.items():
            field.value = path
            field.focus()
            screen.message = ""
            await pilot.press("enter")
            await wait_until(lambda: "-error" in _message_classes(screen) and screen.message)
            line = screen.message
            assert "\n" not in line and "Traceback" not in line, line
            assert named in line, line
            assert screen.reading is None
            assert screen.query_one("#attach-ok").disabled
        await pilot.press("escape")
        await wait_until(lambda: app.screen is main)
        assert main.state.pending_documents is None
        assert service.store.documents() == []
        assert main.session_id is None  # nothing was made

        # A folder picked in the tree, read with a glob: only the files it matches.
        screen = await open_picker(pilot, app)
        await select_in_tree(pilot, screen, "notes")
        await wait_until(lambda: screen.folder is not None)
        screen.query_one("#attach-glob", Input).value = "*.md"
        await pilot.click("#attach-read")
        await wait_until(lambda: screen.reading is not None)
        folder = screen.reading
        assert folder is not None
        assert [row.name for row in folder.documents.rows] == ["a.md", "b.md"]
        assert "tokens" in screen.message and "a.md" in screen.message
        await pilot.press("escape")  # cancelled: nothing attached, nothing stored
        await wait_until(lambda: app.screen is main)
        assert main.state.pending_documents is None and service.store.documents() == []

        # Attached, then taken off again with its ✕: nothing goes with the next message.
        await attach_via_picker(pilot, app, main)
        await pilot.click("#drop-0")
        await wait_until(lambda: main.state.pending_documents is None)
        await wait_until(lambda: main.documents.lines == [])
        assert not main.documents.display or not main.documents.has_class("-shown")
        assert service.store.documents() == []
