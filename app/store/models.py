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


@dataclass(frozen=True)
class SessionSummary:
    session: Session
    messages: int
    tokens: int
    snapshot_bytes: int
    snapshot_tokens: int

    def to_json(self) -> dict[str, Any]:
        s = self.session
        return {
            "id": s.id,
            "title": s.title,
            "messages": self.messages,
            "tokens": self.tokens,
            "created": s.created,
            "updated": s.updated,
            "snapshot_bytes": self.snapshot_bytes,
            "snapshot_tokens": self.snapshot_tokens,
        }


@dataclass(frozen=True)
class Message:
    id: int
    session_id: str
    role: str
    content: str
    created: str
    token_count: int
    partial: bool

    def as_chat(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class SearchHit:
    message: Message
    session_title: str
    snippet: str


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
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SnapshotRow:
        return cls(
            session_id=row["session_id"],
            path=row["path"],
            n_tokens=row["n_tokens"],
            token_ids=unpack_tokens(row["token_ids"]),
            fingerprint=json.loads(row["fingerprint"]),
            n_bytes=row["n_bytes"],
            checksum=row["checksum"],
            created=row["created"],
            last_used=row["last_used"],
            format=row.get("format") or "blob",
            chunk_keys=json.loads(row["chunk_keys"]) if row.get("chunk_keys") else [],
            layout=json.loads(row["layout"]) if row.get("layout") else None,
        )


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
