"""Sessions, branches and reply versions: the part of the conversation service that needs
no model run.

:class:`SessionBook` reads and writes the store (titles, settings, forks, edits, versions,
the remembered sessions) under the sessions' turn locks, and asks the engine host's KV
tiers where a session's memory lives (and to forget it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from kvchat.errors import KvchatError
from kvchat.service.engine_host import EngineHost
from kvchat.service.exports import ExportFormat, export_session, tool_parts
from kvchat.service.reports import (
    SESSION_SETTINGS,
    SESSION_SWITCHES,
    TOOL_SWITCHES,
    tool_switch_problem,
)
from kvchat.service.session_index import LAST_SESSION_KEY, OPEN_SESSION_KEY
from kvchat.service.turn_lock import turn_lock
from kvchat.store import (
    Message,
    SearchHit,
    Session,
    SessionChanges,
    SessionSummary,
    Store,
)
from kvchat.store.figures_sql import MessageFigures
from kvchat.store.locks import SessionBusy, SessionLocks
from kvchat.store.store import StoreFull
from kvchat.store.tags import parse_tags
from kvchat.text import check_text

DEFAULT_TITLE = "New chat"
# A branch's title says what it is and where it starts, first (a narrow list cuts the end):
# "Fork at #7: Title", "Edit of #3: Title", then "Fork at #7 (2): Title"…
_BRANCH_PREFIX = re.compile(r"^(?:Fork at|Edit of) #\d+(?: \((\d+)\))?: ")
# What a fork added to its parent's title before kvchat named branches by what they are.
_FORK_SUFFIX = re.compile(r" \(fork(?: (\d+))?\)$")
# How many sessions a branch's title check reads at a time.
BRANCH_PAGE = 500


class SessionBook:
    """Sessions, messages, forks, edits and reply versions over the store."""

    def __init__(self, store: Store, locks: SessionLocks, host: EngineHost) -> None:
        self.store = store
        self.locks = locks
        self.host = host  # its tiers hold the sessions' KV; its engine counts an edit's tokens

    # --- sessions -------------------------------------------------------------------------

    def new_session(self, title: str | None = None, system_prompt: str | None = None) -> Session:
        if title is not None:
            check_text(title, "the title")
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        session = self.store.create_session(title or DEFAULT_TITLE, system_prompt)
        self.remember(session.id)
        return session

    def resolve(self, ref: str) -> Session:
        """A session by id or unique title prefix; an empty reference names none."""
        check_text(ref, "the session name")
        if not ref.strip():
            raise KvchatError("no session given: name one by its id or title (see `kvchat list`)")
        return self.store.resolve_session(ref)

    def list_sessions(self) -> list[SessionSummary]:
        return self.store.list_sessions()

    def draft(self, session_id: str) -> str:
        """What was typed in the session's input and not sent ("" when nothing)."""
        return self.store.draft(session_id)

    def keep_drafts(self, drafts: dict[str, str]) -> None:
        """Keep each session's unsent input (an empty one removes it)."""
        self.store.set_drafts(drafts)

    def remember_open(self, session_id: str) -> None:
        """Note that the app opened this session: the next launch opens it again.

        Kept apart from the last session used (which a CLI ``ask`` or a new fork moves),
        so a relaunch returns to where the user was. A full disk is no error.
        """
        try:
            self.store.set_meta(OPEN_SESSION_KEY, session_id)
        except StoreFull:
            pass

    def messages(self, session_id: str) -> list[Message]:
        return self.store.messages(session_id)

    def changed_at(self, session_id: str) -> str:
        """When the session last changed, by any process: one row read by its key (the app
        polls it to show what another kvchat wrote to the open session)."""
        return self.store.get_session(session_id).updated

    def turn_holder(self, session_id: str) -> str | None:
        """Why a turn on the session would wait now (another process holds its turn lock),
        or None when it is free: one try of the lock, let go at once."""
        try:
            with self.locks.hold(session_id, wait_s=0):
                return None
        except SessionBusy as exc:
            return str(exc)

    def holding(self, session_id: str) -> AbstractContextManager[None]:
        """Hold the session's turn lock as a turn does (waiting a little for a turn running
        elsewhere, then ``SessionBusy``): what reads a whole session to copy it (fork, edit,
        a bundle) never copies a reply that is still streaming."""
        return turn_lock(self.locks, session_id)

    def add_message(
        self, session_id: str, role: str, text: str, *, token_count: int = 0, partial: bool = False
    ) -> Message:
        """Store a message without running the model (tests, the benchmark, an import)."""
        if role not in ("user", "assistant"):
            raise KvchatError(f"a message's role is user or assistant, not {role!r}")
        check_text(text)
        return self.store.add_message(
            session_id, role, text, token_count=token_count, partial=partial
        )

    def rename(self, session_id: str, title: str) -> Session:
        title = check_text(title, "the title").strip()
        if not title:
            raise KvchatError("a session title cannot be empty")
        return self.store.update_session(session_id, title=title)

    def pin(self, session_id: str, pinned: bool) -> Session:
        """Pin the session (listed first) or unpin it."""
        return self.store.set_pinned(session_id, pinned)

    def tag(self, session_id: str, tags: str) -> Session:
        """Set the session's tags from what the user typed (see kvchat.store.tags)."""
        return self.store.set_tags(session_id, parse_tags(tags))

    def count_tokens(self, session_id: str, limit: int = 2000) -> int:
        """Count (with the loaded model) and store the tokens of up to ``limit`` of the
        session's messages that came without a count (imported); returns how many were
        counted. Nothing is counted before a model is loaded, nor by an engine that takes
        whole messages."""
        loaded = self.host.loaded
        engine = loaded.token_level() if loaded is not None else None
        if engine is None:
            return 0
        uncounted = self.store.uncounted_messages(session_id, limit)
        if not uncounted:
            return 0
        counts = {message_id: len(engine.tokenize(text)) for message_id, text in uncounted}
        self.store.keep_token_counts(session_id, counts)
        return len(counts)

    def figures(self, message_id: int) -> MessageFigures | None:
        """The figures kept with a reply (None: none were, e.g. an imported one)."""
        return self.store.message_figures(message_id)

    @staticmethod
    def tags_problem(tags: str) -> str | None:
        """Why ``tags`` (as typed) are not tags, in one line; None when they are."""
        try:
            parse_tags(tags)
        except KvchatError as exc:
            return str(exc)
        return None

    def configure(
        self,
        session_id: str,
        *,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        """Set a session's system prompt ("" clears it) and sampling overrides."""
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        if settings is not None:
            unknown = set(settings) - set(SESSION_SETTINGS) - set(SESSION_SWITCHES)
            if unknown:
                raise KvchatError(f"unknown session settings: {', '.join(sorted(unknown))}")
            if not isinstance(settings.get("think", False), bool | None):
                raise KvchatError("the think setting is true or false")
            for switch in TOOL_SWITCHES:
                problem = tool_switch_problem(switch, settings.get(switch, []))
                if problem is not None:
                    raise KvchatError(problem)
        return self.store.update_session(session_id, system_prompt=system_prompt, settings=settings)

    def delete(self, session_id: str) -> None:
        """Delete a session, its messages and its KV in every tier (never under a turn that
        another process is running on it: that raises ``SessionBusy``)."""
        with turn_lock(self.locks, session_id):
            self.host.tiers.forget(session_id)
            self.store.delete_session(session_id)
        self.locks.remove(session_id)

    def drop_if_unused(self, session_id: str) -> bool:
        """Delete a session that never got a message and is as it was made (the default
        title, no system prompt, no settings): True if it was. Checked under the session's
        turn lock, so one that a turn elsewhere is writing to is kept."""
        with turn_lock(self.locks, session_id):
            session = self.store.get_session(session_id)
            if self.store.messages(session_id) or (
                session.title != DEFAULT_TITLE or session.system_prompt or session.settings
            ):
                return False
            self.host.tiers.forget(session_id)
            self.store.delete_session(session_id)
        self.locks.remove(session_id)
        return True

    def export(self, session_id: str, fmt: ExportFormat, reasoning: bool = True) -> str:
        """The session as ``fmt`` with its documents (``reasoning`` False: without thinking
        models' reasoning)."""
        messages = self.store.messages(session_id)
        return export_session(
            self.store.get_session(session_id),
            messages,
            fmt,
            reasoning,
            self.store.session_documents(session_id),
            self.store.summaries(session_id),
            tool_parts(self.store, messages),
        )

    def search(self, query: str) -> list[SearchHit]:
        return self.store.search(query)

    def kv_location(self, session_id: str) -> str:
        """Where this session's KV lives now: hot, ram, disk or none."""
        return self.host.tiers.location(session_id)

    def fork(self, session_id: str, at_message: int | None = None) -> Session:
        """A new session with this one's messages up to ``at_message`` (an id; default all).

        Its KV is shared, not copied: a whole-session fork points at the same chunks; an
        earlier fork point finds the shared prefix in the chunks on its first turn. Made
        under the session's turn lock: never from a reply still streaming.
        """
        with turn_lock(self.locks, session_id):
            return self.fork_holding_lock(session_id, at_message)

    def fork_holding_lock(self, session_id: str, at_message: int | None = None) -> Session:
        """:meth:`fork` for a caller that holds the session's turn lock (a compaction)."""
        ids = [m.id for m in self.messages(session_id)]
        if at_message is not None and at_message not in ids:
            raise KvchatError(f"session {session_id} has no message {at_message}")
        kept = ids.index(at_message) + 1 if at_message is not None else len(ids)
        child = self._branch(session_id, at_message, label=f"Fork at #{kept}")
        row = self.store.get_snapshot(session_id)
        if at_message is None and row is not None and row.format == "chunks":
            row.session_id = child.id
            row.created = ""
            self.store.put_snapshot(row)
        return child

    def edit(self, session_id: str, message_id: int, text: str) -> Session:
        """Edit a past user message as a new branch: the original conversation is kept.

        The branch holds the messages before ``message_id`` and the edited message; the
        caller then runs :meth:`regenerate` on it, which reuses the shared prefix's KV.
        """
        text = check_text(text).strip()
        if not text:
            raise KvchatError("the message is empty")
        edited = ("user", text, self.host.engine.count_tokens(text))
        with turn_lock(self.locks, session_id):
            history = self.store.messages(session_id)
            target = next((m for m in history if m.id == message_id), None)
            if target is None or target.role != "user":
                raise KvchatError(f"session {session_id} has no user message {message_id}")
            index = history.index(target)
            upto = history[index - 1].id if index else 0
            return self._branch(session_id, upto, edited, label=f"Edit of #{index + 1}")

    def _branch(
        self,
        session_id: str,
        upto: int | None,
        then: tuple[str, str, int] | None = None,
        *,
        label: str,
    ) -> Session:
        """Copy a session's messages up to ``upto`` (and ``then``) in one transaction, titled
        by ``label`` (what the branch is: "Fork at #7", "Edit of #3")."""
        title = self._branch_title(self.store.get_session(session_id).title, label)
        branch = self.store.copy_session(session_id, title, upto_message=upto, then=then)
        # It reads what the conversation read there (its shared KV fits its prompt).
        self.store.copy_summaries(session_id, branch.id, added=1 if then is not None else 0)
        self.remember(branch.id)
        return branch

    def _branch_title(self, parent_title: str, label: str) -> str:
        """ "Fork at #7: Title", "Edit of #3: Title"; a second branch of the same kind at the
        same point "Fork at #7 (2): Title"…; a branch of a branch names the original title
        once (never "Fork at #2: Fork at #4: …")."""
        base = _BRANCH_PREFIX.sub("", _FORK_SUFFIX.sub("", parent_title)) or parent_title
        taken = 0
        for summary in self._titled(label):  # the branches at this point, not every session
            title = summary.session.title
            match = _BRANCH_PREFIX.match(title)
            if match and title.startswith(label) and title[match.end() :] == base:
                if title[len(label) :].startswith((": ", " (")):
                    taken = max(taken, int(match.group(1) or 1))
        return f"{label}: {base}" if taken == 0 else f"{label} ({taken + 1}): {base}"

    def _titled(self, words: str) -> Iterator[SessionSummary]:
        """Every session whose title holds ``words``, a page at a time (the title index)."""
        after = None
        while True:
            page = self.store.list_sessions_page(BRANCH_PAGE, after, title=words)
            yield from page.sessions
            if page.next is None:
                return
            after = page.next

    def message_at(self, session_id: str, number: int) -> Message:
        """The session's message #``number`` (1-based, in order: what the app shows)."""
        history = self.store.messages(session_id)
        if not 1 <= number <= len(history):
            raise KvchatError(
                f"session {session_id} has no message #{number} "
                f"(it has {len(history)}: #1 to #{len(history)})"
                if history
                else f"session {session_id} has no messages"
            )
        return history[number - 1]

    def remember(self, session_id: str) -> None:
        """Note the session to open next time: a convenience, so a full disk is no error."""
        try:
            self.store.set_meta(LAST_SESSION_KEY, session_id)
        except StoreFull:
            pass

    # --- reply versions ---------------------------------------------------------------------

    def reply_versions(self, message_id: int) -> tuple[int, int]:
        """(the 1-based position of the message's current version, how many it has); a
        message never regenerated is (1, 1)."""
        return self.store.version_of(message_id)

    def reply_versions_in(self, session_id: str) -> dict[int, tuple[int, int]]:
        """:meth:`reply_versions` of every reply of the session with more than one version,
        by message id, in one query."""
        return self.store.versions_in(session_id)

    def switch_version(self, message_id: int, step: int) -> Message | None:
        """Make the previous (``step`` -1) or next (+1) version of the last reply current and
        return it; None at either end. Only the session's last reply switches (the messages
        after an earlier one answer the version they followed).

        Nothing is decoded here: the next turn's prefill reuses the context up to where the
        versions differ, so it decodes this version's reply and the new message only.
        """
        message = self.store.get_message(message_id)
        with turn_lock(self.locks, message.session_id):
            history = self.store.messages(message.session_id)
            if not history or history[-1].id != message_id:
                raise KvchatError(
                    "only the last reply's versions can be switched: the messages after this "
                    "one answer the version they followed"
                )
            return self.store.switch_version(message_id, step)

    # --- the session list at scale (issue 26) -------------------------------------------------

    def sessions_changed_since(self, stamp: int) -> SessionChanges:
        """Sessions made or changed after ``stamp`` and those deleted, by any process, with
        the stamp to ask from next (indexed reads of what changed, never the whole list)."""
        return self.store.sessions_changed_since(stamp)
