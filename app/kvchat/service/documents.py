"""Documents in a conversation: what a session was given, where it goes in the prompt, and
the KV of a set of documents read once for every conversation about them.

Placement (see DESIGN.md, "What else goes into a prompt"):

- Documents given when a conversation starts render as one block (``kvchat.documents``'
  canonical order) after the system prompt, in the system message. Every conversation
  started with the same system prompt and documents then begins with the same tokens, up
  to where the template starts the first question (:meth:`DocumentShelf.shared_end`).
- The first conversation to read that prefix also saves it as a *reading*: a snapshot of
  its own under an id of its own whose chunks end exactly there. Later conversations restore
  it (or a conversation that continued it) and decode only their own question.
- A document added later goes into the text of that turn's user message, before it: read
  once for that conversation, kept by its own snapshots.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import xxhash

from kvchat.documents import Document, Kind, attach, canonical_order, render_block
from kvchat.engine import TokenEngine, common_prefix
from kvchat.errors import KvchatError
from kvchat.store import Message, Session, Store
from kvchat.store.documents_sql import DocumentRow, SessionDocument

ChatMessage = dict[str, str]

# A reading's snapshot row is named by 24 hex digits: no session id (8) is that long.
READING_ID_LENGTH = 24
# Two questions that differ in their first character: where their prompts part is where
# a template starts the first question (ChatML after "<|im_start|>user\n", Gemma after
# the system text it folds into the first user turn).
_PROBES = ("a", "b")


@dataclass(frozen=True)
class AttachedDocument:
    """One document as a turn report and a listing show it."""

    name: str
    kind: str
    size: int
    sha256: str
    tokens: int
    pages: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "size": self.size,
            "sha256": self.sha256,
            "tokens": self.tokens,
            "pages": self.pages,
        }


@dataclass(frozen=True)
class ReadDocuments:
    """What the paths a user named gave: rows ready to store, and a line per file skipped."""

    rows: tuple[DocumentRow, ...]
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class DocumentFit:
    """Whether documents fit the context with room for a conversation, with the figures."""

    tokens: int
    n_ctx: int
    room: int  # tokens left for the conversation and its replies
    seconds: float | None  # to read them at this machine's measured prompt speed

    @property
    def share(self) -> float:
        return self.tokens / self.n_ctx if self.n_ctx else 1.0

    def line(self) -> str:
        took = f", about {self.seconds:.0f} s to read here" if self.seconds is not None else ""
        return (
            f"{self.tokens:,} tokens, {self.share:.0%} of the context ({self.n_ctx:,}){took}; "
            f"read once for all conversations about them"
        )


def as_document(row: DocumentRow) -> Document:
    """A stored document as the block renders it (its text as it was read)."""
    try:
        kind = Kind(row.kind)
    except ValueError:
        kind = Kind.TEXT
    return Document(row.name, row.size, row.sha256, kind, row.text, row.pages)


def as_row(document: Document, source: str, *, library: bool = False) -> DocumentRow:
    return DocumentRow(
        id=DocumentRow.key(document.name, document.sha256),
        name=document.name,
        kind=str(document.kind),
        size=document.size,
        sha256=document.sha256,
        text=document.text,
        pages=document.pages,
        source=source,
        in_library=library,
    )


def system_message(system_prompt: str | None, block: str) -> list[ChatMessage]:
    """The system message of a conversation with this system prompt and documents' block
    (none when both are empty)."""
    system = system_prompt or ""
    text = f"{system}\n\n{block}" if system and block else (system or block)
    return [{"role": "system", "content": text}] if text else []


def reading_id(tokens: Sequence[int], model_id: str) -> str:
    """The snapshot row of a reading: its exact tokens and the model that read them."""
    digest = xxhash.xxh3_128()
    digest.update(model_id.encode())
    digest.update(b"\0")
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.hexdigest()[:READING_ID_LENGTH]


def is_reading(session_id: str) -> bool:
    return len(session_id) == READING_ID_LENGTH


class DocumentShelf:
    """The documents of sessions, read at the boundary once and kept as text in SQLite."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # Per engine (gone with it, so a later engine at the same address starts afresh),
        # per batch alignment and system message (by its digest: the text may be megabytes).
        self._shared_ends: WeakKeyDictionary[TokenEngine, dict[tuple[int, bytes], int]] = (
            WeakKeyDictionary()
        )

    # --- reading files ---------------------------------------------------------------------

    @staticmethod
    def read(
        paths: Sequence[str], glob: str | None = None, *, library: bool = False
    ) -> ReadDocuments:
        """Read every path a user named (files and folders) into document rows, in canonical
        order; one :class:`~kvchat.errors.DocumentError` line for a path kvchat will not
        read (nothing of any path is then returned)."""
        found: dict[str, tuple[Document, str]] = {}
        notes: list[str] = []
        for path in paths:
            attached = attach(path, glob=glob)
            notes.extend(attached.notes)
            for document in attached.documents:
                # The library looks at the file again later, from wherever it is asked.
                source = os.path.abspath(path) if library else path
                found.setdefault(f"{document.name}\0{document.sha256}", (document, source))
        if not found:
            raise KvchatError("no documents to attach: " + ("; ".join(notes) or "nothing read"))
        ordered = canonical_order(doc for doc, _ in found.values())
        sources = {f"{doc.name}\0{doc.sha256}": src for doc, src in found.values()}
        rows = tuple(
            as_row(doc, sources[f"{doc.name}\0{doc.sha256}"], library=library) for doc in ordered
        )
        return ReadDocuments(rows, tuple(notes))

    # --- a session's documents -------------------------------------------------------------

    def give(self, session_id: str, read: ReadDocuments, message_id: int | None = None) -> None:
        """Store the documents and say the session uses them: at its start (``message_id``
        None) or with that message."""
        self.store.put_documents(read.rows)
        self.store.attach_documents(session_id, [row.id for row in read.rows], message_id)

    def of_session(self, session_id: str) -> list[SessionDocument]:
        return self.store.session_documents(session_id)

    def start_block(self, session_id: str) -> str:
        """The block of the documents the session started with ("" for none)."""
        start = [
            as_document(u.document) for u in self.of_session(session_id) if u.message_id is None
        ]
        return render_block(start)

    def head(self, session: Session, system_prompt: str | None) -> list[ChatMessage]:
        """The system message of the session's prompts: its system prompt, then the block of
        the documents it started with (none when it has neither)."""
        return system_message(system_prompt, self.start_block(session.id))

    def chat(
        self, session_id: str, messages: Sequence[Message], thinks: bool = False
    ) -> list[ChatMessage]:
        """The messages for a template: a message that came with documents has their block
        before its text."""
        later: dict[int, list[Document]] = {}
        for used in self.of_session(session_id):
            if used.message_id is not None:
                later.setdefault(used.message_id, []).append(as_document(used.document))
        chat = []
        for message in messages:
            entry = message.as_chat(thinks)
            if message.id in later:
                entry["content"] = f"{render_block(later[message.id])}\n\n{entry['content']}"
            chat.append(entry)
        return chat

    def attached(self, session_id: str, count: Callable[[str], int]) -> list[AttachedDocument]:
        """The session's documents with their tokens as ``count`` reads them."""
        return [
            AttachedDocument(
                u.document.name,
                u.document.kind,
                u.document.size,
                u.document.sha256,
                count(render_block([as_document(u.document)])),
                u.document.pages,
            )
            for u in self.of_session(session_id)
        ]

    # --- reading once for every conversation ----------------------------------------------

    def shared_end(self, engine: TokenEngine, head: list[ChatMessage]) -> int:
        """How many tokens every conversation that starts with ``head`` shares: up to where
        the template starts the first question (0 for a head without documents), rounded
        down to where the engine can start a prefill (``batch_align``: repacked weights
        decode in tiles, so a reading that ended between two would be restored only up to
        the tile before it, and a recurrent state, which can't be cut, not at all)."""
        if not head:
            return 0
        known = self._shared_ends.setdefault(engine, {})
        key = (engine.batch_align, xxhash.xxh3_128_digest(head[0]["content"].encode()))
        if key not in known:
            first, second = (
                engine.chat_tokens([*head, {"role": "user", "content": probe}]) for probe in _PROBES
            )
            end = common_prefix(first, second)
            known[key] = end - end % max(1, engine.batch_align)
        return known[key]

    def fit(
        self, engine: TokenEngine, head: list[ChatMessage], reserve: int, speed: float | None
    ) -> DocumentFit:
        """Whether a conversation starting with ``head`` leaves room for a question and a
        reply of ``reserve`` tokens; raises one line when it does not."""
        tokens = self.shared_end(engine, head)
        room = engine.n_ctx - tokens - reserve
        fit = DocumentFit(tokens, engine.n_ctx, room, tokens / speed if speed else None)
        if room < 64:
            raise KvchatError(
                f"the documents take {tokens:,} tokens of a {engine.n_ctx:,}-token context, "
                f"leaving no room for the conversation ({reserve:,} kept for the reply): "
                "attach fewer or raise n_ctx"
            )
        return fit
