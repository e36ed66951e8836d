"""Turns on the last reply: regenerate it (a new version), continue it, switch between its
versions (mixed into ChatService)."""

from __future__ import annotations

from typing import Any

from kvchat.engine import CancelCheck, GenerationStats
from kvchat.errors import KvchatError
from kvchat.service.parts import ServiceParts
from kvchat.service.reports import TokenCallback, TurnReport, generation_params
from kvchat.service.streaming import stream_reply
from kvchat.store import Message


class ReplyTurns(ServiceParts):
    """Regenerate and continue: turns that rework the session's last reply."""

    def regenerate(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """A new version of the last reply (the prompt is already in the context).

        The earlier versions are kept (see :meth:`switch_version`); the new one becomes
        current once it is stored, in one transaction with the version list.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        with self._turn_lock(session_id):
            history = self.store.messages(session_id)
            if not history:
                raise KvchatError("nothing to regenerate: the session has no messages")
            replaces = history[-1].id if history[-1].role == "assistant" else None
            return self._turn(session_id, params, on_token, cancel, no_restore, replaces)

    def continue_reply(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Go on with the last reply (one cut at the token limit): generate more after it and
        append that to the stored message.

        The prompt is the history with the reply left open; the context already holds it
        (hot, or restored), so only what differs is decoded before generating.
        """
        session = self.store.get_session(session_id)
        params = generation_params(self.settings, session.settings, overrides)
        with self._turn_lock(session_id):
            history = self.store.messages(session_id)
            if not history or history[-1].role != "assistant":
                raise KvchatError("nothing to continue: the session does not end with a reply")
            last = history[-1]
            engine = self.load_engine()
            self._remember(session_id)
            head = self._system_head(session)
            base = engine.chat_tokens(head + [m.as_chat() for m in history[:-1]])
            prompt = base + engine.tokenize(last.content)
            if len(prompt) + 1 >= engine.n_ctx:
                raise KvchatError(
                    f"the context is full ({len(prompt):,} of {engine.n_ctx:,} tokens): "
                    "no room to continue this reply"
                )
            stats = GenerationStats()
            restore = self.make_hot(session_id, no_restore=no_restore, prompt=prompt)
            self.tiers.mark_hot(session_id)
            prefill = self._read_prompt(engine, prompt, cancel)
            self.tiers.mark_dirty()
            more = stream_reply(engine, prefill, params, stats, cancel, on_token)
            report = TurnReport.of_run(session_id, more, restore, prefill, stats)
            if more:
                try:
                    message = self.store.update_message(
                        last.id,
                        last.content + more,
                        report.partial,
                        token_count=last.token_count + stats.generated,
                        finish_reason=report.finish_reason,
                    )
                except KvchatError as exc:
                    report.reply_error = f"the continued reply could not be saved: {exc}"
                else:
                    report.message_id = message.id
            if engine.n_tokens < len(prompt):
                base = prompt  # cut short: nothing to settle (see _after_reply)
            self._after_reply(report, session, base)
            return report

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
        with self._turn_lock(message.session_id):
            history = self.store.messages(message.session_id)
            if not history or history[-1].id != message_id:
                raise KvchatError(
                    "only the last reply's versions can be switched: the messages after this "
                    "one answer the version they followed"
                )
            return self.store.switch_version(message_id, step)
