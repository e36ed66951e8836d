"""Attachments on the main screen: the picker, paths named in a message, the documents panel.

What the user picks (Ctrl+\\, or "Attach files" in the palette) or agrees to attach from
a path typed in the message is read in a thread of its own, fitted on the engine thread
(tokens, share of the context, time to read at this machine's measured speed) and shown
before anything is stored; attached, it waits above the input (removable) and goes with the
next message sent: in a conversation with no message yet as its start block (read once for
all conversations started with them), else with that message (read once for this
conversation). A file re-attached after it changed on disk is never mixed in: the
conversation keeps the text it was read with, and the app offers a new conversation with
the new version. A path kvchat will not read is one line, and nothing is stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.tui.main.context import ATTACH_OFFER, ScreenContext
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.screen_state import ready_or_say
from kvchat.tui.main.signals import DocumentsChanged, SendRequested
from kvchat.tui.pasted_paths import named_paths, resolved
from kvchat.tui.screens.attach import AttachScreen, OfferDialog, Reading, size_text
from kvchat.tui.widgets.documents import DocumentLine, PendingLine

if TYPE_CHECKING:
    from kvchat.service.documents import DocumentFit, ReadDocuments
    from kvchat.service.reports import TurnReport


def later_line(fit: DocumentFit) -> str:
    """The fit line of documents sent with a message of a conversation under way."""
    took = f", about {fit.seconds:.0f} s to read here" if fit.seconds is not None else ""
    return (
        f"{fit.tokens:,} tokens, {fit.share:.0%} of the context ({fit.n_ctx:,}){took}; "
        "read once for this conversation"
    )


def turn_line(report: TurnReport, at_start: bool | None) -> str:
    """What a turn with documents did: tokens reused and decoded, and where the documents'
    reading came from."""
    counts = f"last turn: {report.tokens.reused:,} tokens reused, {report.tokens.decoded:,} decoded"
    restore = report.restore
    if at_start is False:
        how = "the documents were read once for this conversation"
    elif restore.donor is not None and restore.tokens:
        how = f"the documents were restored ({restore.tokens:,} tokens read by an earlier conversation)"
    elif at_start:
        how = "the documents were read once for all conversations started with them"
    else:
        return counts
    return f"{counts} · {how}"


def changed_names(stored: Sequence[Any], read: ReadDocuments) -> list[str]:
    """The documents just read that the conversation holds in another version: same name
    (or the same file), other sha256. ``stored``: the session's documents
    (``DocumentShelf.of_session``)."""
    names = []
    for row in read.rows:
        for used in stored:
            held = used.document
            same_file = held.name == row.name or (held.source and held.source == row.source)
            if same_file and held.sha256 != row.sha256 and row.name not in names:
                names.append(row.name)
    return names


def merged(first: ReadDocuments, second: ReadDocuments) -> ReadDocuments:
    """Both sets of documents, each once, in the order attached."""
    from kvchat.service.documents import ReadDocuments

    rows = {row.id: row for row in (*first.rows, *second.rows)}
    return ReadDocuments(tuple(rows.values()), (*first.notes, *second.notes))


class Attachments:
    """The picker, the offer of paths named in a message, the pending attachments (it owns
    ``state.pending_documents``) and the documents panel (see the module docstring)."""

    def __init__(self, ctx: ScreenContext, *, opener: SessionOpener) -> None:
        self.ctx = ctx
        self.opener = opener

    # --- reading and fitting ----------------------------------------------------------------

    async def read(
        self, paths: Sequence[str], glob: str | None, *, at_start: bool | None = None
    ) -> Reading:
        """Read ``paths`` in a thread of their own (never the UI thread), then fit them as the
        next message would carry them (``at_start``: as a new conversation's start block);
        one KvchatError line when kvchat will not read them or they do not fit."""
        from kvchat.service.documents import DocumentShelf

        documents = await asyncio.to_thread(DocumentShelf.read, list(paths), glob)
        return await self.fit(documents, tuple(paths), glob, at_start=at_start)

    async def fit(
        self,
        documents: ReadDocuments,
        paths: tuple[str, ...],
        glob: str | None,
        *,
        at_start: bool | None = None,
    ) -> Reading:
        backend, session_id = self.ctx.backend, self.ctx.state.session_id
        if at_start is None:
            at_start = session_id is None or not await backend.on_store(
                backend.chat.reader.messages_page, session_id, 1
            )
        fit = await backend.on_engine(self._engine_fit, documents, session_id, at_start)
        if fit is None:
            line = "the server reads them in its own context"
        else:
            line = fit.line() if at_start else later_line(fit)
        return Reading(documents, line, at_start, paths, glob, session_id)

    def _engine_fit(
        self, documents: ReadDocuments, session_id: str | None, at_start: bool
    ) -> DocumentFit | None:
        """On the engine thread: the figures of the documents as the next message carries
        them (one line when they do not fit)."""
        from kvchat.service.reports import generation_params

        service = self.ctx.backend.chat
        session = service.sessions.resolve(session_id) if session_id is not None else None
        settings = session.settings if session is not None else {}
        max_tokens = generation_params(service.host.settings, settings, {}).max_tokens
        if at_start or session_id is None:
            system = session.system_prompt if session is not None else None
            return service.turns.check_documents(documents, system, max_tokens)
        return service.turns.check_later_documents(session_id, documents, max_tokens)

    # --- attaching ----------------------------------------------------------------------------

    async def pick(self, preset: Sequence[str] = ()) -> bool:
        """Ctrl+\\: the picker; what is attached waits for the next message. Whether
        something was attached."""
        if not ready_or_say(self.ctx.app, self.ctx.state):
            return False
        if not preset:  # paths named in the message so far are read at once
            preset = [resolved(p) for p in self._unattached(self.ctx.prompt.text)]
        screen = AttachScreen(self.read, Path.cwd(), preset)
        reading = await self.ctx.app.push_screen_wait(screen)
        if reading is None:
            return False
        return await self.take(reading)

    async def take(self, reading: Reading) -> bool:
        """Keep ``reading`` for the next message, unless the conversation holds another
        version of one of its files: then it says so and offers a new conversation with the
        new version (declined: nothing is attached)."""
        from kvchat.tui.screens.dialogs import ConfirmDialog

        backend, state = self.ctx.backend, self.ctx.state
        if state.session_id is not None:
            stored = await backend.on_store(backend.chat.documents.of_session, state.session_id)
            changed = changed_names(stored, reading.documents)
            if changed:
                self.ctx.post(DocumentsChanged())  # the panel says which file changed
                names = ", ".join(changed)
                self.ctx.app.notify(
                    f"{names} changed on disk since this conversation read it; the "
                    "conversation keeps the text it was read with",
                    severity="warning",
                    markup=False,
                )
                wanted = await self.ctx.app.push_screen_wait(
                    ConfirmDialog(
                        f"{names} changed on disk: start a new conversation with the new version?",
                        "This conversation keeps the version it was read with.",
                        yes="New conversation",
                    )
                )
                if not wanted:
                    return False
                session_id = await self.opener.new_session_id()
                await self.ctx.refresh()
                await self.opener.open(session_id, focus_prompt=True)
                state.pending_documents = None
                reading = await self.fit(
                    reading.documents, reading.paths, reading.glob, at_start=True
                )
        pending = state.pending_documents
        if pending is not None:
            reading = await self.fit(
                merged(pending.documents, reading.documents),
                (*pending.paths, *reading.paths),
                reading.glob,
                at_start=reading.at_start,
            )
        state.pending_documents = reading
        self.ctx.post(DocumentsChanged())
        return True

    def remove(self, index: int) -> None:
        """The ✕ of a pending attachment: it no longer goes with the next message."""
        from kvchat.service.documents import ReadDocuments

        pending = self.ctx.state.pending_documents
        if pending is None or not 0 <= index < len(pending.documents.rows):
            return
        rows = tuple(r for i, r in enumerate(pending.documents.rows) if i != index)
        if not rows:
            self.ctx.state.pending_documents = None
        else:
            kept = ReadDocuments(rows, pending.documents.notes)
            line = "fewer documents than the figures above were counted for"
            self.ctx.state.pending_documents = Reading(
                kept,
                f"{pending.fit_line} ({line})",
                pending.at_start,
                pending.paths,
                pending.glob,
                pending.session_id,
            )
        self.ctx.post(DocumentsChanged())

    # --- paths named in a message -------------------------------------------------------

    def _unattached(self, text: str) -> list[str]:
        """The paths ``text`` names that exist and are not attached already."""
        try:
            named = named_paths(text)
        except (OSError, ValueError):
            return []
        pending = self.ctx.state.pending_documents
        attached = set(pending.paths) if pending is not None else set()
        return [p for p in named if resolved(p) not in attached]

    def pasted(self, text: str) -> None:
        """Text pasted into the input that names files or folders: a notice saying how to
        attach them (nothing is attached by itself; the text stays as pasted)."""
        if not self.ctx.state.ready:
            return
        named = self._unattached(text)
        if named:
            self.ctx.app.notify(
                f"{', '.join(named)}: Ctrl+\\ attaches (showing what it takes first); "
                "Enter asks too. The message stays text",
                title="Attach?",
                markup=False,
            )

    def offer(self, text: str) -> bool:
        """Enter on a message that names existing files or folders not attached yet: asks
        whether to attach them (the message waits; True), else False (send it as usual)."""
        state = self.ctx.state
        if not state.ready or state.turn is not None or not text.strip():
            return False
        offered = self._unattached(text)
        if not offered:
            return False
        self.ctx.run(ATTACH_OFFER, self._offer, text, offered)
        return True

    async def _offer(self, text: str, paths: list[str]) -> None:
        """The message waits while the user answers: attach (after seeing the figures),
        send as typed, or Esc (the message goes back to the input)."""
        answer = await self.ctx.app.push_screen_wait(OfferDialog(paths))
        if answer == "send":
            self.ctx.post(SendRequested(text))
            return
        if answer == "attach" and await self.pick([resolved(p) for p in paths]):
            self.ctx.post(SendRequested(text))
            return
        self.ctx.prompt.give_back(text)
        self.ctx.app.notify("Not sent: your message is back in the input")

    # --- the panel ------------------------------------------------------------------------

    async def show_session(self) -> None:
        """Show the pending attachments, the open session's documents and what the last turn
        with documents did."""
        panel, state = self.ctx.documents, self.ctx.state
        pending = await self._refitted(state.pending_documents)
        pending_lines = []
        note = ""
        if pending is not None:
            where = "a new conversation's start" if pending.at_start else "your next message"
            note = f"Attached to {where} (not stored yet): {pending.fit_line}"
            pending_lines = [
                PendingLine(row.name, f"{row.kind} · {size_text(row.size)}")
                for row in pending.documents.rows
            ]
        stored = await self._stored_lines(state.session_id)
        report = state.last_report
        line: str | None = None
        if report is not None and report.documents and report.session_id == state.session_id:
            turn = state.last_turn
            at_start = turn.documents_at_start if turn is not None else None
            line = turn_line(report, at_start)
        await panel.show(pending=pending_lines, pending_note=note, stored=stored, turn_line=line)

    async def _refitted(self, pending: Reading | None) -> Reading | None:
        """The attachments fitted to the conversation open now (another one was open when
        they were attached); dropped, with one line, when they do not fit it."""
        state = self.ctx.state
        if pending is None or pending.session_id == state.session_id or state.turn is not None:
            return pending
        try:
            refitted = await self.fit(pending.documents, pending.paths, pending.glob)
        except KvchatError as exc:
            if state.pending_documents is pending:
                state.pending_documents = None
            self.ctx.app.notify(
                f"{pending.names}: not attached to this conversation: {exc}",
                severity="warning",
                markup=False,
            )
            return None
        if state.pending_documents is not pending:  # changed meanwhile: that one is shown
            return state.pending_documents
        state.pending_documents = refitted
        return refitted

    async def _stored_lines(self, session_id: str | None) -> list[DocumentLine]:
        backend = self.ctx.backend
        if session_id is None or backend.service is None:
            return []
        try:
            used = await backend.on_store(backend.chat.documents.of_session, session_id)
            if not used:
                return []
            tokens = await backend.on_engine(self._engine_tokens, session_id)
            positions = await backend.on_store(self._positions, session_id)
        except KvchatError:
            return []
        notes = await asyncio.to_thread(_file_notes, [u.document for u in used])
        lines = []
        for index, u in enumerate(used):
            doc = u.document
            where = (
                "at start"
                if u.message_id is None
                else f"with message #{positions.get(u.message_id, '?')}"
            )
            count = tokens[index] if tokens is not None and index < len(tokens) else None
            lines.append(
                DocumentLine(
                    doc.name,
                    doc.kind,
                    size_text(doc.size),
                    count,
                    where,
                    notes[index],
                    doc.in_library,
                )
            )
        return lines

    def _engine_tokens(self, session_id: str) -> list[int] | None:
        """On the engine thread: each of the session's documents' tokens (None: the engine
        counts no tokens here)."""
        service = self.ctx.backend.chat
        engine = service.host.load().token_level()
        if engine is None:
            return None
        return [d.tokens for d in service.documents.attached(session_id, engine.count_tokens)]

    def _positions(self, session_id: str) -> dict[int, int]:
        """On the store thread: message id → its number in the conversation (1 = first)."""
        messages = self.ctx.backend.chat.sessions.messages(session_id)
        return {m.id: n for n, m in enumerate(messages, start=1)}


def _file_notes(documents: Sequence[Any]) -> list[str | None]:
    """In a thread of its own: for each stored document, whether the file it was read from
    changed on disk or is gone (the conversation keeps the text it was read with)."""
    from kvchat.service.library import file_note

    notes: list[str | None] = []
    for document in documents:
        try:
            note = file_note(document)
        except (OSError, ValueError):
            note = None
        if note == "changed on disk":
            note = "changed on disk: this conversation keeps the text it read"
        notes.append(note)
    return notes
