"""Plain records the store hands out; no SQL and no behaviour beyond conversion."""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Session:
    id: str
    title: str
    system_prompt: str | None
    settings: dict[str, Any]
    created: str
    updated: str
    parent_id: str | None = None  # the session a fork or an edit was made from
    pinned: bool = False  # listed first (see migration m023)
    tags: tuple[str, ...] = ()  # lowercase words without the "#" (see kvchat.store.tags)


@dataclass(frozen=True)
class SessionSummary:
    session: Session
    messages: int
    tokens: int
    snapshot_bytes: int
    snapshot_tokens: int

    @property
    def size(self) -> int:
        """The session's size in tokens, the one figure the app's list and ``kvchat list``
        show: what its saved KV holds (the template's tokens too), else its messages'
        counts summed."""
        return self.snapshot_tokens or self.tokens

    def to_json(self) -> dict[str, Any]:
        s = self.session
        return {
            "id": s.id,
            "title": s.title,
            "messages": self.messages,
            "tokens": self.size,
            "message_tokens": self.tokens,
            "created": s.created,
            "updated": s.updated,
            "snapshot_bytes": self.snapshot_bytes,
            "snapshot_tokens": self.snapshot_tokens,
            "pinned": s.pinned,
            "tags": list(s.tags),
        }


@dataclass(frozen=True)
class SessionPage:
    """One page of the session list, newest first; ``next`` is the cursor of the page after
    it (pass it back as ``after``), None on the last page."""

    sessions: list[SessionSummary]
    next: tuple[str, int] | None


@dataclass(frozen=True)
class SessionChanges:
    """What changed in the session list after a change stamp: the sessions made or changed
    since (newest change last), the ids deleted since, and the stamp to ask from next."""

    stamp: int
    changed: list[SessionSummary]
    deleted: list[str]


@dataclass(frozen=True)
class Message:
    id: int
    session_id: str
    role: str
    content: str
    created: str
    token_count: int
    partial: bool
    # Why a reply ended ("stop", "length", "cancelled", "context"); None: not known (your
    # messages, a reply still streaming, one stored before kvchat recorded it).
    finish_reason: str | None = None
    # A thinking model's reasoning before the answer ("" when it had none), kept apart
    # from the answer in ``content`` (see kvchat.service.reasoning).
    reasoning: str = ""

    def as_chat(self, with_reasoning: bool = False) -> dict[str, str]:
        """The message for a chat template; ``with_reasoning``: its reasoning too, as
        ``reasoning_content`` (a thinking model's template decides what to keep of it)."""
        chat = {"role": self.role, "content": self.content}
        if with_reasoning and self.reasoning:
            chat["reasoning_content"] = self.reasoning
        return chat


@dataclass(frozen=True)
class SearchHit:
    message: Message
    session_title: str
    snippet: str  # the matching words are between \x02 and \x03 (never in text itself)


@dataclass(frozen=True)
class MessageWindow:
    """A run of a session's messages read on the (session, id) index, and where it sits:
    what an app shows of a long session without reading the rest."""

    messages: list[Message]
    first: int  # the session's messages before ``messages[0]``
    total: int  # the session's messages, as its row counts them
    updated: str  # when the session last changed, by any process
    # The current version of the session's last reply and how many it has, when the window
    # ends with that reply ((1, 1) otherwise): only that reply switches versions.
    last_version: tuple[int, int] = (1, 1)

    @property
    def later(self) -> int:
        """The session's messages after the window's last one."""
        return self.total - self.first - len(self.messages)


def pack_tokens(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    out = array("i")
    out.frombytes(blob)
    return out.tolist()


@dataclass
class SnapshotRow:
    """The index entry of a session's cold snapshot file."""

    session_id: str
    path: str
    n_tokens: int
    token_ids: list[int]
    fingerprint: dict[str, Any]
    n_bytes: int
    checksum: str
    created: str = ""
    last_used: str = ""
    format: str = "blob"  # "blob": one file at ``path``; "chunks": ``chunk_keys`` in order
    chunk_keys: list[str] = field(default_factory=list)
    layout: dict[str, Any] | None = None
    # Why this row cannot be trusted (set by from_row on a damaged row), else None.
    damage: str | None = None
    # Sliding-window models: the window cells kept for branch points, as pieces
    # [start, end, chunk key] of positions [start, end) (chunks only).
    checkpoints: list[list[Any]] = field(default_factory=list)

    def to_row(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "path": self.path,
            "n_tokens": self.n_tokens,
            "token_ids": pack_tokens(self.token_ids),
            "model_id": self.fingerprint.get("model_id"),
            "llama_cpp_version": self.fingerprint.get("llama_cpp_version"),
            "type_k": self.fingerprint.get("type_k"),
            "type_v": self.fingerprint.get("type_v"),
            "flash_attn": int(bool(self.fingerprint.get("flash_attn"))),
            "rope_freq_base": self.fingerprint.get("rope_freq_base"),
            "rope_freq_scale": self.fingerprint.get("rope_freq_scale"),
            "n_swa": self.fingerprint.get("n_swa"),
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            "n_bytes": self.n_bytes,
            "checksum": self.checksum,
            "created": self.created,
            "last_used": self.last_used,
            "format": self.format,
            "chunk_keys": json.dumps(self.chunk_keys) if self.format == "chunks" else None,
            "layout": json.dumps(self.layout) if self.layout is not None else None,
            "checkpoints": json.dumps(self.checkpoints) if self.checkpoints else None,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SnapshotRow:
        """Never raises: a damaged row comes back with ``damage`` saying what is wrong, so
        it fails only its own session's restore (and ``cache gc`` removes it)."""
        problems: list[str] = []

        def column(name: str, kind: type, default: Any) -> Any:
            value = row.get(name)
            if isinstance(value, kind) and not isinstance(value, bool):
                return value
            if value is not None or name not in ("created", "last_used", "chunk_keys", "layout"):
                problems.append(f"column {name} is not {kind.__name__}")
            return default

        blob = column("token_ids", bytes, b"")
        if len(blob) % 4:
            problems.append(f"token_ids holds {len(blob)} bytes, not whole tokens")
            blob = b""
        tokens = unpack_tokens(blob)
        n_tokens = column("n_tokens", int, 0)
        if n_tokens != len(tokens):
            problems.append(f"n_tokens {n_tokens} does not match its {len(tokens)} token ids")
        n_bytes = column("n_bytes", int, 0)
        if n_bytes < 0:
            problems.append(f"n_bytes {n_bytes} is negative")
        fingerprint = _json_column(row, "fingerprint", dict, problems) or {}
        chunk_keys = _json_column(row, "chunk_keys", list, problems) or []
        if not all(isinstance(k, str) for k in chunk_keys):
            problems.append("chunk_keys is not a list of keys")
            chunk_keys = []
        layout = _json_column(row, "layout", dict, problems)
        checkpoints = _json_column(row, "checkpoints", list, problems) or []
        if not all(
            isinstance(c, list)
            and len(c) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in c[:2])
            and 0 <= c[0] < c[1]
            and isinstance(c[2], str)
            for c in checkpoints
        ):
            problems.append("checkpoints is not a list of [start, end, key]")
            checkpoints = []
        return cls(
            session_id=str(row.get("session_id")),
            path=column("path", str, ""),
            n_tokens=n_tokens,
            token_ids=tokens,
            fingerprint=fingerprint,
            n_bytes=n_bytes,
            checksum=column("checksum", str, ""),
            created=column("created", str, ""),
            last_used=column("last_used", str, ""),
            format=row.get("format") if row.get("format") in ("blob", "chunks") else "?",
            chunk_keys=chunk_keys,
            layout=layout,
            checkpoints=checkpoints,
            damage="; ".join(problems)
            if problems
            else (
                None
                if row.get("format") in ("blob", "chunks")
                else f"unknown snapshot format {row.get('format')!r}"
            ),
        )


def _json_column(row: dict[str, Any], name: str, kind: type, problems: list[str]) -> Any:
    """A JSON column that must hold a ``kind`` (None when empty or damaged)."""
    text = row.get(name)
    if text is None or text == "":
        return None
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        problems.append(f"column {name} is not valid JSON")
        return None
    if not isinstance(value, kind):
        problems.append(f"column {name} is not a JSON {'object' if kind is dict else 'list'}")
        return None
    return value


@dataclass
class ChunkRow:
    """One stored token-range chunk: cells [start, start + n_tokens) of some prefix."""

    key: str
    path: str
    start: int
    n_tokens: int
    n_bytes: int
    checksum: str
    created: str = ""
    last_used: str = ""
