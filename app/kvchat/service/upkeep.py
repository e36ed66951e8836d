"""Keeping the context in shape around a turn: moving messages that left the window out of
the KV (a shift), and re-decoding a finished reply as the next prompt will hold it (settle)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvchat.errors import KvchatError
from kvchat.kvcache.tiers import SnapshotWrite
from kvchat.service.context_window import plan_shift, settle_target
from kvchat.service.parts import ServiceParts
from kvchat.service.reports import Housekeeping, TurnReport, WindowShift
from kvchat.store import Session
from kvchat.text import model_title, short_title

# How the model is asked for a session's title (see ContextUpkeep._name_session).
TITLE_SYSTEM = (
    "You name conversations. Reply with a short title of two to six words and nothing else."
)
TITLE_SOURCE_CHARS = 600
TITLE_TOKENS = 16


class ContextUpkeep(ServiceParts):
    """The window shift before a turn; the settle and snapshot write after it, which yield to a
    new message (mixed into ChatService)."""

    def _shift_window(
        self,
        head: list[dict[str, str]],
        chat: list[dict[str, str]],
        prompt: list[int],
        dropped: int,
    ) -> WindowShift:
        """When old messages left the window: move them out of the KV instead of re-reading.

        :func:`kvchat.service.context_window.plan_shift` finds the block of held tokens those messages
        are; those positions are removed and the rest shifted down (a context shift), so
        the prefill reuses the shifted KV and decodes only the new turn. An engine whose
        cache cannot shift re-reads the kept window, and says so.
        """
        engine = self.engine
        plan = plan_shift(engine.chat_tokens, head, chat, engine.tokens, prompt, dropped)
        if plan is None:
            return WindowShift()
        kept = f"re-read the kept window ({len(prompt) - plan.start:,} tokens after the first {plan.start:,})"
        if not plan.found:
            return WindowShift(
                note=f"the context does not hold the messages that left the window: {kept}"
            )
        if not engine.capabilities.can_shift:
            return WindowShift(note=f"this model's KV cache cannot be shifted: {kept}")
        n_discard = engine.shift(plan.start, plan.end)
        if not n_discard:
            return WindowShift(
                note="llama.cpp did not take back the shifted KV: "
                f"re-read the kept window ({len(prompt):,} tokens)"
            )
        return WindowShift(tokens=n_discard, messages=plan.messages)

    # --- after a reply: the settle and the snapshot write ("housekeeping") ----------------

    def _init_upkeep(self) -> None:
        self._pending_upkeep: PendingUpkeep | None = None
        # Set from any thread when a new message waits: housekeeping stops at its next batch.
        self._yield_now = threading.Event()
        # A UI that runs housekeep() itself when idle sets this: a turn then returns as soon
        # as its reply is stored, and leaves the settle and the snapshot write pending.
        self.defer_housekeeping = False

    def interrupt_housekeeping(self) -> None:
        """A new message waits: housekeeping under way (or about to start) stops at its next
        batch, and what is left is dropped when that message's turn starts. Safe to call from
        any thread (a UI calls it before queueing the new turn on its engine thread)."""
        self._yield_now.set()

    def allow_housekeeping(self) -> None:
        """Housekeeping may run again: an interrupt that no turn followed (a switch of
        version, a fork) would otherwise stop every later :meth:`housekeep` at once. A UI
        calls it on its engine thread as each user action's work starts."""
        self._yield_now.clear()

    @property
    def housekeeping_pending(self) -> bool:
        """Whether the last turn's settle or snapshot write has not run (or not finished)."""
        return self._pending_upkeep is not None

    def housekeep(self) -> Housekeeping:
        """Run what the last turn left pending: the settle, from where it stopped (the
        context's valid prefix), then the snapshot write. Yields as soon as
        :meth:`interrupt_housekeeping` is called; ``finished`` says whether it all ran. For a
        UI's engine thread when idle (see ``defer_housekeeping``). Never raises: another
        process's turn on the session leaves it pending."""
        pending = self._pending_upkeep
        if pending is None:
            return Housekeeping()
        try:
            with self.locks.hold(pending.session_id, 0):
                return self._run_upkeep()
        except (KvchatError, OSError) as exc:
            return Housekeeping(finished=False, note=f"housekeeping waits: {exc}")

    def _after_reply(
        self, report: TurnReport, session: Session, prompt: list[int], dropped: int = 0
    ) -> None:
        """Queue the settle (when a reply was stored and the context holds the prompt) and
        the snapshot write; run them now unless a UI defers them."""
        self._record_model(session.id)  # the session remembers its model (ModelChoices)
        engine = self.engine
        target = None
        if report.message_id is not None and engine.n_tokens >= len(prompt):
            try:
                target = self._settle_target(session, prompt, dropped)
            except KvchatError as exc:
                report.window_note = f"the context was left as generated ({exc})"
        self._pending_upkeep = PendingUpkeep(
            session.id, len(prompt), target, title=self._wants_title(report, session)
        )
        if self.defer_housekeeping:
            return
        done = self._run_upkeep()
        report.snapshot = done.snapshot or SnapshotWrite()
        report.window_note = done.note or report.window_note

    def _settle_target(self, session: Session, prompt: list[int], dropped: int) -> list[int]:
        """What the context should hold after the reply: exactly the next turn's prompt up
        to the user's words (see :func:`kvchat.service.context_window.settle_target`)."""
        engine = self.engine
        messages = self.store.messages(session.id)[dropped:]  # the window's messages
        chat = self._system_head(session) + [m.as_chat() for m in messages]
        return settle_target(engine.chat_tokens, chat, prompt, engine.tokens, engine.n_ctx)

    def _run_upkeep(self) -> Housekeeping:
        """The settle, then the snapshot write; each step first checks for a new message.

        The settle re-decodes the reply in batches (see ``Engine.settle``) followed by what
        the template puts between the reply and the next user's words: known already, so
        decoding it now takes it off the next turn's time to first token, and the KV is
        then a full prefill's (a greedy reply after a restore equals one after a prefill).
        """
        pending, done = self._pending_upkeep, Housekeeping()
        if pending is None:
            return done
        if self.tiers.hot_session_id != pending.session_id:
            self._pending_upkeep = None  # the context moved on (and saved what it held)
            return done
        engine = self.engine
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
            done.snapshot = self.tiers.save_hot()
            pending.snapshot_due = False
        if pending.title is not None:
            if self._yield_now.is_set():
                done.finished = False
                return done
            done.title = self._name_session(pending.session_id, pending.title)
            pending.title = None
        self._pending_upkeep = None
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
        engine = self.engine
        try:
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

    def _abandon_upkeep(self) -> None:
        """New work on the context starts: housekeeping not done is dropped.

        A settle not finished leaves the context cut back to its valid prefix (the reply as
        generated, token by token, is not a full prefill's KV): the next prefill decodes
        from there. The snapshot is written by the next save (the context stays unsaved).
        """
        pending, self._pending_upkeep = self._pending_upkeep, None
        self._yield_now.clear()
        if pending is None or pending.target is None:
            return
        if self.tiers.hot_session_id == pending.session_id:
            self.engine.settle(pending.keep, pending.target, lambda: True)


@dataclass
class PendingUpkeep:
    """What a turn left to do on the hot context."""

    session_id: str
    keep: int  # the context's valid prefix (the prompt, then what the settle re-decoded)
    target: list[int] | None  # what the settle leaves the context holding (None: done)
    # The automatic title the model's replaces (None: no title to make).
    title: str | None = None
    snapshot_due: bool = True
