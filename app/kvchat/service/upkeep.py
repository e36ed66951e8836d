"""Keeping the context in shape after a turn ("housekeeping"): re-decoding the finished reply
as the next prompt will hold it (the settle), the snapshot write, and the session's title
from the model. Each step yields to a new message."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvchat.config import Settings
from kvchat.engine import common_prefix
from kvchat.errors import KvchatError
from kvchat.kvcache.tiers import SnapshotWrite
from kvchat.service.context_window import after_summary, settle_target, with_summary
from kvchat.service.documents import DocumentShelf
from kvchat.service.engine_host import EngineHost
from kvchat.service.reports import Housekeeping, TurnReport
from kvchat.store import Session, Store
from kvchat.store.locks import SessionLocks
from kvchat.text import model_title, short_title

# How the model is asked for a session's title (see Upkeep._name_session).
TITLE_SYSTEM = (
    "You name conversations. Reply with a short title of two to six words and nothing else."
)
TITLE_SOURCE_CHARS = 600
TITLE_TOKENS = 16


class Upkeep:
    """What the last turn left to do on the hot context, run at once or, for a UI that
    defers it, when the UI is idle (see :attr:`deferred`)."""

    def __init__(
        self, host: EngineHost, store: Store, locks: SessionLocks, documents: DocumentShelf
    ) -> None:
        self.host = host
        self.documents = documents
        self.store = store
        self.locks = locks
        self._pending: PendingUpkeep | None = None
        # Set from any thread when a new message waits: housekeeping stops at its next batch.
        self._yield_now = threading.Event()
        # A UI that runs housekeep() itself when idle sets this: a turn then returns as soon
        # as its reply is stored, and leaves the settle and the snapshot write pending.
        self.deferred = False

    @property
    def settings(self) -> Settings:
        return self.host.settings

    def interrupt(self) -> None:
        """A new message waits: housekeeping under way (or about to start) stops at its next
        batch, and what is left is dropped when that message's turn starts. Safe to call from
        any thread (a UI calls it before queueing the new turn on its engine thread)."""
        self._yield_now.set()

    def allow(self) -> None:
        """Housekeeping may run again: an interrupt that no turn followed (a switch of
        version, a fork) would otherwise stop every later :meth:`run_pending` at once. A UI
        calls it on its engine thread as each user action's work starts."""
        self._yield_now.clear()

    @property
    def pending(self) -> bool:
        """Whether the last turn's settle or snapshot write has not run (or not finished)."""
        return self._pending is not None

    def run_pending(self) -> Housekeeping:
        """Run what the last turn left pending: the settle, from where it stopped (the
        context's valid prefix), then the snapshot write. Yields as soon as
        :meth:`interrupt` is called; ``finished`` says whether it all ran. For a
        UI's engine thread when idle (see :attr:`deferred`). Never raises: another
        process's turn on the session leaves it pending."""
        pending = self._pending
        if pending is None:
            return Housekeeping()
        try:
            with self.locks.hold(pending.session_id, 0):
                return self._run()
        except (KvchatError, OSError) as exc:
            return Housekeeping(finished=False, note=f"housekeeping waits: {exc}")

    def after_reply(
        self, report: TurnReport, session: Session, prompt: list[int], dropped: int = 0
    ) -> None:
        """Queue the settle (when a reply was stored and the context holds the prompt) and
        the snapshot write; run them now unless a UI defers them."""
        engine = self.host.token_engine()
        target = None
        if report.message_id is not None and engine.n_tokens >= len(prompt):
            try:
                target = self._settle_target(session, prompt, dropped)
            except KvchatError as exc:
                report.window_note = f"the context was left as generated ({exc})"
        keep = len(prompt)
        if target is not None:
            held = engine.tokens
            same = common_prefix(held, target)
            report.tokens.rerendered = len(held) - same
            keep = min(keep, same)  # the template may render the prompt's tail otherwise
        self._pending = PendingUpkeep(
            session.id, keep, target, title=self._wants_title(report, session)
        )
        if self.deferred:
            return
        done = self._run()
        report.snapshot = done.snapshot or SnapshotWrite()
        report.window_note = done.note or report.window_note

    def _settle_target(self, session: Session, prompt: list[int], dropped: int) -> list[int]:
        """What the context should hold after the reply: exactly the next turn's prompt up
        to the user's words (see :func:`kvchat.service.context_window.settle_target`)."""
        engine = self.host.token_engine()
        summary = self.store.current_summary(session.id)
        messages, summarized = after_summary(self.store.messages(session.id), summary)
        messages = messages[dropped:]  # the window's messages
        head = self.documents.head(session, session.system_prompt or self.settings.system_prompt)
        if summary is not None and summarized:
            head = with_summary(head, summary.text)
        thinks = self.host.reasoning_style.thinks
        chat = head + self.documents.chat(session.id, messages, thinks)
        return settle_target(engine.chat_tokens, chat, prompt, engine.tokens, engine.n_ctx)

    def _run(self) -> Housekeeping:
        """The settle, then the snapshot write; each step first checks for a new message.

        The settle re-decodes the reply in batches (see ``Engine.settle``) followed by what
        the template puts between the reply and the next user's words: known already, so
        decoding it now takes it off the next turn's time to first token, and the KV is
        then a full prefill's (a greedy reply after a restore equals one after a prefill).
        """
        pending, done = self._pending, Housekeeping()
        if pending is None:
            return done
        tiers = self.host.tiers
        if tiers.hot_session_id != pending.session_id:
            self._pending = None  # the context moved on (and saved what it held)
            return done
        engine = self.host.token_engine()
        if pending.target is not None:
            started = time.perf_counter()
            try:
                done.settled = engine.settle(pending.keep, pending.target, self._yield_now.is_set)
            except KvchatError as exc:
                done.note = f"the context was left as generated ({exc})"
                pending.target = None
            else:
                done.settle_ms = (time.perf_counter() - started) * 1000
                pending.keep = engine.n_tokens
                if engine.n_tokens < len(pending.target):
                    done.finished = False
                    return done
                pending.target = None
        if self._yield_now.is_set():
            done.finished = False
            return done
        if pending.snapshot_due:
            done.snapshot = tiers.save_hot()
            pending.snapshot_due = False
        if pending.title is not None:
            if self._yield_now.is_set():
                done.finished = False
                return done
            done.title = self._name_session(pending.session_id, pending.title)
            pending.title = None
        self._pending = None
        return done

    def _wants_title(self, report: TurnReport, session: Session) -> str | None:
        """The automatic title to replace with the model's, after a session's first reply
        (None: not this time: a later reply, a title set by the user, auto_title off)."""
        if not self.settings.auto_title or report.message_id is None:
            return None
        messages = self.store.messages(session.id)
        if len(messages) != 2 or messages[0].role != "user":
            return None
        automatic = short_title(messages[0].content)
        return automatic if self.store.get_session(session.id).title == automatic else None

    def _name_session(self, session_id: str, automatic: str) -> str | None:
        """Ask the model for a title beside the conversation (the scratch sequence: the
        session's KV and tokens are untouched) and keep it unless the user renamed the
        session meanwhile; the title, or None."""
        first = self.store.messages(session_id)[0].content
        ask = [
            {"role": "system", "content": TITLE_SYSTEM},
            {"role": "user", "content": f"Name this conversation:\n\n{first[:TITLE_SOURCE_CHARS]}"},
        ]
        try:
            engine = self.host.token_engine()
            reply = engine.generate_aside(engine.chat_tokens(ask), TITLE_TOKENS)
        except KvchatError:
            return None
        title = model_title(reply or "")
        if title is None or self.store.get_session(session_id).title != automatic:
            return None
        try:
            self.store.update_session(session_id, title=title)
        except (KvchatError, OSError):
            return None
        return title

    def abandon(self) -> None:
        """New work on the context starts: housekeeping not done is dropped.

        A settle not finished leaves the context cut back to its valid prefix (the reply as
        generated, token by token, is not a full prefill's KV): the next prefill decodes
        from there. The snapshot is written by the next save (the context stays unsaved).
        """
        pending, self._pending = self._pending, None
        self._yield_now.clear()
        if pending is None or pending.target is None:
            return
        loaded = self.host.loaded
        engine = loaded.token_level() if loaded is not None else None
        if engine is not None and self.host.tiers.hot_session_id == pending.session_id:
            engine.settle(pending.keep, pending.target, lambda: True)


@dataclass
class PendingUpkeep:
    """What a turn left to do on the hot context."""

    session_id: str
    keep: int  # the context's valid prefix (the prompt, then what the settle re-decoded)
    target: list[int] | None  # what the settle leaves the context holding (None: done)
    # The automatic title the model's replaces (None: no title to make).
    title: str | None = None
    snapshot_due: bool = True
