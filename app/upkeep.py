"""Keeping the context in shape around a turn: moving messages that left the window out of
the KV (a shift), and re-decoding a finished reply as the next prompt will hold it (settle)."""

from __future__ import annotations

from kvchat.service_parts import ServiceParts
from kvchat.store import Session
from kvchat.turns import WindowShift
from kvchat.window import plan_shift, settle_target


class ContextUpkeep(ServiceParts):
    """The window shift before a turn and the settle after it (mixed into ChatService)."""

    def _shift_window(
        self,
        head: list[dict[str, str]],
        chat: list[dict[str, str]],
        prompt: list[int],
        dropped: int,
    ) -> WindowShift:
        """When old messages left the window: move them out of the KV instead of re-reading.

        :func:`kvchat.window.plan_shift` finds the block of held tokens those messages
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

    def _settle(self, session: Session, prompt: list[int], dropped: int = 0) -> int:
        """Leave the context holding exactly the next turn's prompt up to the user's words.

        The reply is re-decoded in batches (see ``Engine.settle``), followed by what the
        template puts between the reply and the next user's words (see
        :func:`kvchat.window.settle_target`): known already, so decoding it now takes it
        off the next turn's time to first token. Returns the number of tokens decoded.
        """
        engine = self.engine
        messages = self.store.messages(session.id)[dropped:]  # the window's messages
        chat = self._system_head(session) + [m.as_chat() for m in messages]
        target = settle_target(engine.chat_tokens, chat, prompt, engine.tokens, engine.n_ctx)
        return engine.settle(len(prompt), target)
