"""Running the model for a turn: the new reply to the session's history, and the probe the
benchmark times (mixed into ChatService)."""

from __future__ import annotations

from kvchat.engine import CancelCheck, GenerationParams, GenerationStats
from kvchat.errors import KvchatError
from kvchat.generation import StreamSaver, stream_reply
from kvchat.service_parts import ServiceParts
from kvchat.turns import TokenCallback, TurnReport
from kvchat.window import fit_window


class TurnRunner(ServiceParts):
    """A turn's model work: make the session hot, fit and shift the window, prefill, stream
    the reply (kept as it streams), store it, settle, save the snapshot."""

    # How often a streaming reply is stored (ChatService sets it from STREAM_SAVE_EVERY_S).
    stream_save_every_s: float

    def probe_turn(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (for ``kvchat bench``).

        The session is made hot from scratch each time (the hot tier is skipped), and the
        context is left holding the probe, so the hot session is forgotten afterwards.
        """
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self._abandon_upkeep()
        self.tiers.spill()
        restore = self.make_hot(session_id, no_restore=no_restore)
        chat = [m.as_chat() for m in self.store.messages(session_id)]
        prompt = engine.chat_tokens(
            self._system_head(session) + chat + [{"role": "user", "content": text}]
        )
        prefill = engine.prefill(prompt)
        params = GenerationParams(temperature=0.0, max_tokens=1)
        reply = "".join(engine.generate(params, stats))
        self.tiers.mark_hot(None)
        return TurnReport.of_run(session_id, reply, restore, prefill, stats)

    def _history_tokens(self, session_id: str) -> list[int] | None:
        """The session's whole history as prompt tokens (None when it has no messages)."""
        history = self.store.messages(session_id)
        if not history:
            return None
        session = self.store.get_session(session_id)
        chat = self._system_head(session) + [m.as_chat() for m in history]
        return self.engine.chat_tokens(chat)

    def _turn(
        self,
        session_id: str,
        params: GenerationParams,
        on_token: TokenCallback | None,
        cancel: CancelCheck | None,
        no_restore: bool,
        replaces: int | None = None,
    ) -> TurnReport:
        """Run the model on the session's history (without message ``replaces``) and store
        its reply (as a new version of ``replaces``: the earlier ones are kept). Called with
        the session's turn lock held."""
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self._remember(session_id)
        history = [m for m in self.store.messages(session_id) if m.id != replaces]
        chat = [m.as_chat() for m in history]
        reserve = min(params.max_tokens, engine.n_ctx // 4)
        head = self._system_head(session)
        prompt, dropped = fit_window(engine.chat_tokens, head, chat, engine.n_ctx, reserve)
        restore = self.make_hot(session_id, no_restore=no_restore, prompt=prompt)
        self.tiers.mark_hot(session_id)
        shift = self._shift_window(head, chat, prompt, dropped)
        prefill = engine.prefill(prompt, cancel)
        self.tiers.mark_dirty()
        # A new reply is kept as it streams (a regenerated one is not: the old reply stays
        # until the new one is whole), so a killed process leaves the partial text.
        saver = (
            StreamSaver(self.store, session_id, self.stream_save_every_s)
            if replaces is None
            else None
        )
        reply = stream_reply(engine, prefill, params, stats, cancel, on_token, saver)
        streamed = saver.message_id if saver is not None else None
        report = TurnReport.of_run(
            session_id,
            reply,
            restore,
            prefill,
            stats,
            dropped_messages=dropped,
            shifted_tokens=shift.tokens,
            shifted_messages=shift.messages,
            window_note=shift.note,
        )
        # From here on the reply exists: whatever fails is reported, never raised.
        if reply.strip():
            try:
                if replaces is not None:  # a new version; the earlier ones are kept
                    message = self.store.add_version(
                        replaces, reply, token_count=stats.generated, partial=report.partial
                    )
                elif streamed is not None:  # the final commit replaces the streamed text
                    message = self.store.update_message(
                        streamed, reply, report.partial, token_count=stats.generated
                    )
                else:
                    message = self.store.add_message(
                        session_id,
                        "assistant",
                        reply,
                        token_count=stats.generated,
                        partial=report.partial,
                    )
            except KvchatError as exc:
                report.reply_error = f"the reply could not be saved: {exc}"
            else:
                report.message_id = message.id
        elif streamed is not None:
            try:
                self.store.delete_message(streamed)
            except KvchatError:
                pass
        self._after_reply(report, session, prompt, dropped)
        return report
