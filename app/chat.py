"""The conversation service: one turn = store + engine + kvcache. It knows no UI.

Not thread-safe: a UI runs every call that touches the engine on one worker thread.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.config import Settings, data_dir
from kvchat.engine import Engine, EngineConfig, GenerationParams, common_prefix
from kvchat.engine.engine import CancelCheck, GenerationStats
from kvchat.errors import KvchatError
from kvchat.export import ExportFormat, export_session
from kvchat.kvcache import Fingerprint, RestoreResult, SnapshotStore
from kvchat.kvcache.warm import WarmTier
from kvchat.planner.defaults import DefaultsChoice, plan_defaults
from kvchat.store import Message, SearchHit, Session, SessionSummary, Store

TokenCallback = Callable[[str], None]
DEFAULT_TITLE = "New chat"
LAST_SESSION_KEY = "last_session"
# Sampling settings a session may override.
SESSION_SETTINGS = ("temperature", "top_p", "max_tokens", "seed")


@dataclass
class TokenCounts:
    prompt: int = 0
    reused: int = 0
    decoded: int = 0
    generated: int = 0


@dataclass
class SnapshotWrite:
    bytes: int = 0  # the snapshot's state size
    ms: float = 0.0
    error: str | None = None
    written: int = 0  # bytes written to disk for it (only new chunks)
    chunks_written: int = 0
    chunks_shared: int = 0


@dataclass
class TurnReport:
    """Everything a UI shows about one turn; ``to_json`` is the CLI's ``--json`` object."""

    session_id: str
    reply: str
    tokens: TokenCounts
    restore: RestoreResult
    ttft_ms: float | None
    tokens_per_s: float | None
    finish_reason: str
    message_id: int | None = None
    dropped_messages: int = 0
    snapshot: SnapshotWrite = field(default_factory=SnapshotWrite)
    # Context overflow on this turn: tokens and messages moved out of the KV by a shift, or
    # why the kept window was re-read instead (see ChatService._shift_window).
    shifted_tokens: int = 0
    shifted_messages: int = 0
    window_note: str | None = None

    @property
    def partial(self) -> bool:
        return self.finish_reason in ("cancelled", "context")

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "reply": self.reply,
            "finish_reason": self.finish_reason,
            "tokens": {
                "prompt": self.tokens.prompt,
                "reused": self.tokens.reused,
                "decoded": self.tokens.decoded,
                "generated": self.tokens.generated,
            },
            "restore": self.restore.to_json(),
            "timing": {
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
                "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            },
            "window": {
                "dropped_messages": self.dropped_messages,
                "shifted_messages": self.shifted_messages,
                "shifted_tokens": self.shifted_tokens,
                "note": self.window_note,
            },
            "snapshot": {
                "bytes": self.snapshot.bytes,
                "written": self.snapshot.written,
                "chunks_written": self.snapshot.chunks_written,
                "chunks_shared": self.snapshot.chunks_shared,
                "ms": round(self.snapshot.ms, 2),
                "error": self.snapshot.error,
            },
        }

    def summary(self) -> str:
        """One line for a status bar or stderr, e.g. "restored 312 tokens from disk in 4 ms · …"."""
        r = self.restore
        if r.source == "hot":
            head = f"hot context, reused {self.tokens.reused:,} tokens"
        elif r.source in ("ram", "disk"):
            head = f"restored {r.tokens:,} tokens from {r.source} in {r.ms:,.0f} ms"
        else:
            head = f"full prefill: {r.reason}"
        parts = [head, f"decoded {self.tokens.decoded:,}"]
        if self.ttft_ms is not None:
            parts.append(f"first token {self.ttft_ms:,.0f} ms")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.shifted_tokens:
            parts.append(
                f"KV shift: {self.shifted_messages} old messages ({self.shifted_tokens:,} tokens) "
                f"left the window, {self.dropped_messages} out in all (text kept)"
            )
        elif self.dropped_messages:
            parts.append(f"{self.dropped_messages} old messages left the window")
        if self.window_note:
            parts.append(self.window_note)
        if self.finish_reason == "cancelled":
            parts.append("cancelled")
        return " · ".join(parts)


class ChatService:
    """Sessions and turns over one store, one snapshot store and one (lazily loaded) engine."""

    def __init__(self, settings: Settings, home: Path | None = None) -> None:
        """``home`` overrides the data directory (the benchmark uses a scratch one)."""
        self.settings = settings
        directory = home or data_dir()
        self.store = Store(directory / "kvchat.db")
        self.snapshots = SnapshotStore(
            directory / "snapshots",
            self.store,
            chunk_tokens=settings.chunk_tokens,
            budget_bytes=int(settings.disk_cache_gib * 2**30),
            chunked=settings.snapshot_chunks,
        )
        self.warm = WarmTier(settings.ram_cache_mib * 2**20)
        self.snapshots.cleanup_orphans()
        self._engine: Engine | None = None
        self._fingerprint: Fingerprint | None = None
        # n_ctx, KV types, flash attention and GPU layers as planned (see load_engine).
        self.plan: DefaultsChoice | None = None
        self.hot_session_id: str | None = None
        # The hot context holds KV that no snapshot has yet (e.g. a failed save).
        self._hot_dirty = False

    # --- engine ---------------------------------------------------------------------------

    def load_engine(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        if self._engine is None:
            path = self.settings.model_path()
            self.plan = plan_defaults(self.settings, path)
            s = self.plan.apply(self.settings)
            self._engine = Engine(
                EngineConfig(
                    model_path=path,
                    n_ctx=s.n_ctx,
                    n_batch=s.n_batch,
                    n_threads=s.n_threads,
                    n_gpu_layers=s.n_gpu_layers,
                    type_k=s.type_k,
                    type_v=s.type_v,
                    flash_attn=s.flash_attn,
                )
            )
            self._fingerprint = Fingerprint.current(path, self._engine.layout())
        return self._engine

    @property
    def engine(self) -> Engine:
        return self.load_engine()

    @property
    def plan_note(self) -> str | None:
        """The context settings chosen for this machine, one line (None before the model loads)."""
        return self.plan.note if self.plan is not None else None

    @property
    def fingerprint(self) -> Fingerprint:
        self.load_engine()
        assert self._fingerprint is not None
        return self._fingerprint

    def close(self) -> None:
        """Save the hot session if it has unsaved KV, then release everything."""
        if self._engine is not None:
            if self._hot_dirty and self.hot_session_id:
                self.save_hot()
            self._engine.close()
            self._engine = None
        self.store.close()

    # --- sessions -------------------------------------------------------------------------

    def new_session(self, title: str | None = None, system_prompt: str | None = None) -> Session:
        session = self.store.create_session(title or DEFAULT_TITLE, system_prompt)
        self.store.set_meta(LAST_SESSION_KEY, session.id)
        return session

    def resolve(self, ref: str) -> Session:
        return self.store.resolve_session(ref)

    def list_sessions(self) -> list[SessionSummary]:
        return self.store.list_sessions()

    def last_session(self) -> Session | None:
        session_id = self.store.get_meta(LAST_SESSION_KEY)
        if session_id:
            try:
                return self.store.get_session(session_id)
            except KvchatError:
                pass
        sessions = self.store.list_sessions()
        return sessions[0].session if sessions else None

    def messages(self, session_id: str) -> list[Message]:
        return self.store.messages(session_id)

    def rename(self, session_id: str, title: str) -> Session:
        title = title.strip()
        if not title:
            raise KvchatError("a session title cannot be empty")
        return self.store.update_session(session_id, title=title)

    def configure(
        self,
        session_id: str,
        *,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        """Set a session's system prompt ("" clears it) and sampling overrides."""
        if settings is not None:
            unknown = set(settings) - set(SESSION_SETTINGS)
            if unknown:
                raise KvchatError(f"unknown session settings: {', '.join(sorted(unknown))}")
        return self.store.update_session(session_id, system_prompt=system_prompt, settings=settings)

    def delete(self, session_id: str) -> None:
        """Delete a session, its messages and its snapshot file."""
        if self.hot_session_id == session_id:
            self.hot_session_id = None
            self._hot_dirty = False
            if self._engine is not None:
                self._engine.clear()
        self.warm.drop(session_id)
        self.snapshots.delete(session_id)
        self.store.delete_session(session_id)

    def export(self, session_id: str, fmt: ExportFormat) -> str:
        return export_session(self.store.get_session(session_id), self.store.messages(session_id), fmt)

    def search(self, query: str) -> list[SearchHit]:
        return self.store.search(query)

    def kv_location(self, session_id: str) -> str:
        """Where this session's KV lives now: hot, ram, disk or none."""
        if session_id == self.hot_session_id:
            return "hot"
        if session_id in self.warm:
            return "ram"
        return "disk" if self.store.get_snapshot(session_id) is not None else "none"

    def fork(self, session_id: str, at_message: int | None = None) -> Session:
        """A new session with this one's messages up to ``at_message`` (an id; default all).

        Its KV is shared, not copied: a whole-session fork points at the same chunks; an
        earlier fork point finds the shared prefix in the chunks on its first turn.
        """
        parent = self.store.get_session(session_id)
        history = self.store.messages(session_id)
        if at_message is not None:
            ids = [m.id for m in history]
            if at_message not in ids:
                raise KvchatError(f"session {session_id} has no message {at_message}")
            history = history[: ids.index(at_message) + 1]
        child = self.store.create_session(
            f"{parent.title} (fork)", parent.system_prompt, parent.settings
        )
        for message in history:
            self.store.add_message(
                child.id, message.role, message.content,
                token_count=message.token_count, partial=message.partial,
            )
        row = self.store.get_snapshot(session_id)
        if at_message is None and row is not None and row.format == "chunks":
            row.session_id = child.id
            row.created = ""
            self.store.put_snapshot(row)
        self.store.set_meta(LAST_SESSION_KEY, child.id)
        return self.store.get_session(child.id)

    def edit(self, session_id: str, message_id: int, text: str) -> Session:
        """Edit a past user message as a new branch: the original conversation is kept.

        The branch holds the messages before ``message_id`` and the edited message; the
        caller then runs :meth:`regenerate` on it, which reuses the shared prefix's KV.
        """
        text = text.strip()
        if not text:
            raise KvchatError("the message is empty")
        history = self.store.messages(session_id)
        target = next((m for m in history if m.id == message_id), None)
        if target is None or target.role != "user":
            raise KvchatError(f"session {session_id} has no user message {message_id}")
        index = history.index(target)
        if index:
            branch = self.fork(session_id, at_message=history[index - 1].id)
        else:
            parent = self.store.get_session(session_id)
            branch = self.store.create_session(
                f"{parent.title} (fork)", parent.system_prompt, parent.settings
            )
            self.store.set_meta(LAST_SESSION_KEY, branch.id)
        self.store.add_message(
            branch.id, "user", text, token_count=self.engine.count_tokens(text)
        )
        return self.store.get_session(branch.id)

    def cache_stats(self) -> dict[str, Any]:
        """Both tiers and the persistent counters, for ``kvchat cache`` and the app."""
        rows = self.store.snapshots()
        counters = self.store.counters()
        return {
            "ram": {
                "entries": len(self.warm),
                "bytes": self.warm.bytes,
                "budget_bytes": self.warm.budget_bytes,
                "hits": self.warm.hits,
                "misses": self.warm.misses,
            },
            "disk": {
                "snapshots": len(rows),
                "chunks": len(self.store.all_chunks()),
                "bytes": self.snapshots.disk_bytes(),
                "logical_bytes": sum(r.n_bytes for r in rows),
                "budget_bytes": self.snapshots.budget_bytes,
            },
            "counters": {
                "restores_ram": counters.get("restores_ram", 0),
                "restores_disk": counters.get("restores_disk", 0),
                "misses": counters.get("restore_misses", 0),
                "tokens_restored": counters.get("tokens_restored", 0),
                "bytes_restored": counters.get("bytes_restored", 0),
                "bytes_written": counters.get("bytes_written", 0),
            },
        }

    # --- turns ----------------------------------------------------------------------------

    def send(
        self,
        session_id: str,
        text: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Commit the user's message, then run the model and commit its reply."""
        text = text.strip()
        if not text:
            raise KvchatError("the message is empty")
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self.store.add_message(session_id, "user", text, token_count=engine.count_tokens(text))
        if session.title == DEFAULT_TITLE:
            self.store.update_session(session_id, title=_title_from(text))
        return self._turn(session_id, on_token, cancel, no_restore, overrides)

    def regenerate(
        self,
        session_id: str,
        *,
        on_token: TokenCallback | None = None,
        cancel: CancelCheck | None = None,
        no_restore: bool = False,
        **overrides: Any,
    ) -> TurnReport:
        """Replace the last reply with a new one (the prompt is already in the context)."""
        history = self.store.messages(session_id)
        if not history:
            raise KvchatError("nothing to regenerate: the session has no messages")
        if history[-1].role == "assistant":
            self.store.delete_message(history[-1].id)
        return self._turn(session_id, on_token, cancel, no_restore, overrides)

    def make_hot(
        self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
    ) -> RestoreResult:
        """Bring a session's KV into the context from the best tier that has it.

        Hot (already in the context) → RAM → disk (its own snapshot, or with ``prompt``
        the longest prefix another session's snapshot shares) → none.
        """
        engine = self.load_engine()
        if no_restore:
            self._drop_hot()
            engine.clear()
            return RestoreResult("none", reason="full prefill requested (--no-restore)")
        if session_id == self.hot_session_id:
            return RestoreResult("hot", tokens=engine.n_tokens)
        self._drop_hot()
        if prompt is None and self.store.get_snapshot(session_id) is None:
            # No KV of its own (a new branch): look for the prefix it shares with others.
            prompt = self._history_tokens(session_id)
        started = time.perf_counter()
        entry = self.warm.get(session_id, self.fingerprint.model_id)
        if entry is not None and len(entry.tokens) <= engine.n_ctx:
            if engine.state_set(entry.pointer(), entry.n_bytes, entry.tokens):
                self.hot_session_id = session_id
                self.store.bump_counters(
                    restores_ram=1, tokens_restored=len(entry.tokens), bytes_restored=entry.n_bytes
                )
                elapsed = (time.perf_counter() - started) * 1000
                return RestoreResult("ram", ms=elapsed, bytes=entry.n_bytes, tokens=len(entry.tokens))
            self.warm.drop(session_id)
        result = self.snapshots.restore(session_id, engine, self.fingerprint, prompt)
        self.hot_session_id = session_id
        return result

    def _drop_hot(self) -> None:
        """Before the context is overwritten: keep the hot session's KV (disk and RAM)."""
        engine = self._engine
        if self.hot_session_id and engine is not None and engine.n_tokens:
            if self._hot_dirty:
                self.save_hot()
            self.warm.put(
                self.hot_session_id, engine.tokens, engine.state_get(), self.fingerprint.model_id
            )
        self.hot_session_id = None

    def save_hot(self) -> SnapshotWrite:
        """Snapshot the hot context to disk; a failure is reported, never raised."""
        if not self.hot_session_id or self._engine is None or self._engine.n_tokens == 0:
            return SnapshotWrite()
        started = time.perf_counter()
        try:
            saved = self.snapshots.save(self.hot_session_id, self._engine, self.fingerprint)
        except OSError as exc:
            return SnapshotWrite(error=f"could not save the KV snapshot: {exc}")
        self._hot_dirty = False
        return SnapshotWrite(
            bytes=saved.row.n_bytes,
            ms=(time.perf_counter() - started) * 1000,
            written=saved.bytes_written,
            chunks_written=saved.chunks_written,
            chunks_shared=saved.chunks_shared,
        )

    def probe_turn(self, session_id: str, text: str, *, no_restore: bool = False) -> TurnReport:
        """Time the next turn up to its first token, committing nothing (for ``kvchat bench``).

        The session is made hot from scratch each time (the hot tier is skipped), and the
        context is left holding the probe, so the hot session is forgotten afterwards.
        """
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        engine = self.load_engine()
        self._drop_hot()
        restore = self.make_hot(session_id, no_restore=no_restore)
        history = self.store.messages(session_id)
        chat = [m.as_chat() for m in history] + [{"role": "user", "content": text}]
        prompt = engine.chat_tokens(self._system_head(session) + chat)
        prefill = engine.prefill(prompt)
        params = GenerationParams(temperature=0.0, max_tokens=1)
        pieces = list(engine.generate(params, stats))
        self.hot_session_id = None
        return TurnReport(
            session_id=session_id,
            reply="".join(pieces),
            tokens=TokenCounts(len(prompt), prefill.reused, prefill.decoded, stats.generated),
            restore=restore,
            ttft_ms=stats.ttft_ms,
            tokens_per_s=stats.tokens_per_s,
            finish_reason=stats.finish_reason,
        )

    def _params(self, session: Session, overrides: dict[str, Any]) -> GenerationParams:
        values: dict[str, Any] = {
            key: getattr(self.settings, key) for key in SESSION_SETTINGS
        }
        values.update({k: v for k, v in session.settings.items() if k in SESSION_SETTINGS})
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(SESSION_SETTINGS)
        if unknown:
            raise TypeError(f"unknown generation settings: {unknown}")
        if values["seed"] is None:
            values["seed"] = secrets.randbits(31)
        return GenerationParams(
            temperature=float(values["temperature"]),
            top_p=float(values["top_p"]),
            max_tokens=int(values["max_tokens"]),
            seed=int(values["seed"]),
        )

    def _history_tokens(self, session_id: str) -> list[int] | None:
        """The session's whole history as prompt tokens (None when it has no messages)."""
        history = self.store.messages(session_id)
        if not history:
            return None
        session = self.store.get_session(session_id)
        chat = self._system_head(session) + [m.as_chat() for m in history]
        return self.engine.chat_tokens(chat)

    def _system_head(self, session: Session) -> list[dict[str, str]]:
        system = session.system_prompt or self.settings.system_prompt
        return [{"role": "system", "content": system}] if system else []

    def _window(
        self, session: Session, history: list[Message], reserve: int
    ) -> tuple[list[int], int]:
        """Prompt tokens for the newest messages that fit n_ctx minus ``reserve``.

        The system prompt always stays; the oldest messages leave the window first (their
        text stays in SQLite). Returns the tokens and how many messages were left out.
        """
        engine = self.engine
        head = self._system_head(session)
        chat = [m.as_chat() for m in history]
        budget = engine.n_ctx - reserve
        for dropped in range(len(chat)):
            window = chat[dropped:]
            if window and window[0]["role"] == "assistant":
                continue
            tokens = engine.chat_tokens(head + window)
            if len(tokens) <= budget:
                return tokens, dropped
        raise KvchatError(
            f"the last message does not fit the context (n_ctx={engine.n_ctx}); "
            "shorten it or raise n_ctx"
        )

    def _turn(
        self,
        session_id: str,
        on_token: TokenCallback | None,
        cancel: CancelCheck | None,
        no_restore: bool,
        overrides: dict[str, Any],
    ) -> TurnReport:
        stats = GenerationStats()
        session = self.store.get_session(session_id)
        params = self._params(session, overrides)
        engine = self.load_engine()
        self.store.set_meta(LAST_SESSION_KEY, session_id)
        history = self.store.messages(session_id)
        reserve = min(params.max_tokens, engine.n_ctx // 4)
        prompt, dropped = self._window(session, history, reserve)
        restore = self.make_hot(session_id, no_restore=no_restore, prompt=prompt)
        self.hot_session_id = session_id
        shift = self._shift_window(session, history, prompt, dropped)
        prefill = engine.prefill(prompt, cancel)
        self._hot_dirty = True
        pieces: list[str] = []
        if prefill.reused + prefill.decoded < len(prompt):
            stats.finish_reason = "cancelled"
        else:
            for piece in engine.generate(params, stats, cancel):
                pieces.append(piece)
                if on_token is not None:
                    on_token(piece)
        reply = "".join(pieces)
        report = TurnReport(
            session_id=session_id,
            reply=reply,
            tokens=TokenCounts(len(prompt), prefill.reused, prefill.decoded, stats.generated),
            restore=restore,
            ttft_ms=stats.ttft_ms,
            tokens_per_s=stats.tokens_per_s,
            finish_reason=stats.finish_reason,
            dropped_messages=dropped,
            shifted_tokens=shift.tokens,
            shifted_messages=shift.messages,
            window_note=shift.note,
        )
        if reply.strip():
            message = self.store.add_message(
                session_id,
                "assistant",
                reply,
                token_count=stats.generated,
                partial=report.partial,
            )
            report.message_id = message.id
        if engine.n_tokens >= len(prompt):
            self._settle(session, prompt, dropped)
        report.snapshot = self.save_hot()
        return report

    def _shift_window(
        self, session: Session, history: list[Message], prompt: list[int], dropped: int
    ) -> WindowShift:
        """When old messages left the window: move them out of the KV instead of re-reading.

        The context holds the rendering of some earlier window (messages ``start:``), the
        new prompt renders messages ``dropped:``. In token space the new prompt is the held
        rendering minus one block ``[p0, p1)`` (the messages ``start:dropped``, aligned on
        the template's message boundaries): ``p0`` is the common prefix (the system prompt
        and the first tokens stay) and ``p1 = p0 + (held - prompt)``, checked to line up on
        both sides. Those positions are removed and the rest shifted down (llama.cpp's
        context shift); the prefill then reuses the shifted KV and decodes only the new
        turn. A model whose cache cannot shift re-reads the kept window, and says so.
        """
        engine = self.engine
        held = engine.tokens
        if not dropped or not held:
            return WindowShift()
        p0 = common_prefix(held, prompt)
        if p0 >= len(prompt) or p0 >= len(held):
            return WindowShift()  # the context is already this window (or a prefix of it)
        head = self._system_head(session)
        chat = [m.as_chat() for m in history]
        for start in range(dropped - 1, -1, -1):  # the most recent window first
            if start and chat[start]["role"] == "assistant":
                continue  # _window never starts a window with a reply
            rendered = engine.chat_tokens(head + chat[start:])
            p1 = p0 + len(rendered) - len(prompt)
            if p1 <= p0 or p1 >= len(held):
                continue
            if rendered[:p0] != prompt[:p0] or rendered[p1:] != prompt[p0:]:
                continue  # the dropped messages are not one block of tokens here
            if held[:p1] != rendered[:p1] or held[p1] != rendered[p1]:
                continue  # the context does not hold this rendering
            if not engine.can_shift():
                return WindowShift(
                    note=f"this model's KV cache cannot be shifted: re-read the kept window "
                    f"({len(prompt) - p0:,} tokens after the first {p0:,})"
                )
            n_discard = engine.shift(p0, p1)
            if not n_discard:
                return WindowShift(note="llama.cpp did not take back the shifted KV: "
                                   f"re-read the kept window ({len(prompt):,} tokens)")
            return WindowShift(tokens=n_discard, messages=dropped - start)
        return WindowShift(
            note="the context does not hold the messages that left the window: "
            f"re-read the kept window ({len(prompt) - p0:,} tokens after the first {p0:,})"
        )

    def _settle(self, session: Session, prompt: list[int], dropped: int = 0) -> int:
        """Leave the context holding exactly the next turn's prompt up to the user's words.

        The reply is re-decoded in batches (see :meth:`Engine.settle`), followed by what
        the template puts between the reply and the next user's words (e.g.
        ``<|im_end|>\n<|im_start|>user\n``): known already, so decoding it now takes it
        off the next turn's time to first token. That opening is the common prefix of the
        prompts for two different next messages. Returns the number of tokens decoded.
        """
        engine = self.engine
        messages = self.store.messages(session.id)[dropped:]  # the window's messages
        chat = self._system_head(session) + [m.as_chat() for m in messages]
        first = engine.chat_tokens(chat + [{"role": "user", "content": "A"}])
        second = engine.chat_tokens(chat + [{"role": "user", "content": "B"}])
        shared = common_prefix(first, second)
        if first[: len(prompt)] == prompt and len(prompt) < shared < engine.n_ctx - 1:
            target = first[:shared]
        else:  # the template re-rendered the history differently: settle what is there
            target = engine.tokens
        return engine.settle(len(prompt), target)


@dataclass
class WindowShift:
    """What a turn did when messages left the window: a KV shift, or a note why not."""

    tokens: int = 0
    messages: int = 0
    note: str | None = None


def _title_from(text: str, limit: int = 48) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
