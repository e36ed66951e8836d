"""The document library (``kvchat docs``): documents the user keeps, read ahead of time.

Adding a document stores its text (the truth, as for any attachment) and reads it once,
now, for the current model and KV type: the prefix every conversation started with that
document shares (the system prompt, then its block, up to where the template starts the
question) is saved as a *reading*, the same hidden snapshot the first conversation about
an attached document saves (see :mod:`kvchat.service.documents`). A new conversation about
the document then restores it and decodes only its question. The library pins its
readings: the disk budget never evicts them until the document is removed.

A reading is keyed by the exact tokens and the model file and KV types that read them, so
another model or KV type means another read (:meth:`DocumentLibrary.plan` says so first).
A document is added with its reading, or not at all: a cancelled read stores nothing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvchat.documents import DEFAULT_BOUNDS, render_block
from kvchat.documents.reading import read_bytes
from kvchat.engine import CancelCheck, TokenEngine
from kvchat.errors import DocumentError, KvchatError
from kvchat.kvcache import RestoreResult
from kvchat.service.context_window import reply_reserve
from kvchat.service.documents import (
    DocumentShelf,
    ReadDocuments,
    as_document,
    reading_id,
    system_message,
)
from kvchat.service.engine_host import EngineHost
from kvchat.service.reports import reading_phrase
from kvchat.store import Store
from kvchat.store.documents_sql import DocumentRow, LibraryReading

# (document name, tokens read so far, tokens to read, seconds since its read started)
ReadProgress = Callable[[str, int, int, float], None]
# A question's first character: where a template starts the question (see shared_end).
_PROBE_QUESTION = "a"


@dataclass(frozen=True)
class ReadingFigures:
    """One of a library document's readings as ``docs list`` shows it."""

    model: str
    kv_type: str
    tokens: int
    disk_bytes: int  # 0: its snapshot is not on disk (cleared by `kvchat cache clear`)
    current: bool  # read with the model and KV type in use now

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "kv_type": self.kv_type,
            "tokens": self.tokens,
            "kv_bytes": self.disk_bytes,
            "on_disk": self.disk_bytes > 0,
        }


@dataclass(frozen=True)
class LibraryEntry:
    """A library document with its readings, the conversations using it and whether its
    file changed since it was read."""

    document: DocumentRow
    readings: tuple[ReadingFigures, ...]
    conversations: int
    file_note: str | None  # "changed on disk", "gone from disk", or None

    @property
    def tokens(self) -> int:
        return max((r.tokens for r in self.readings), default=0)

    @property
    def disk_bytes(self) -> int:
        return sum(r.disk_bytes for r in self.readings)

    def to_json(self) -> dict[str, object]:
        doc = self.document
        return {
            "id": doc.id,
            "name": doc.name,
            "kind": doc.kind,
            "size": doc.size,
            "sha256": doc.sha256,
            "source": doc.source,
            "added": doc.added,
            "tokens": self.tokens,
            "kv_bytes": self.disk_bytes,
            "conversations": self.conversations,
            "readings": [r.to_json() for r in self.readings],
            "file": self.file_note,
        }


@dataclass(frozen=True)
class ReadAhead:
    """What adding one document did: its reading, and how many tokens were read now (0:
    another conversation or an earlier add had read it; ``restored`` came from disk)."""

    document: DocumentRow
    reading_id: str
    tokens: int
    decoded: int
    restored: int
    seconds: float
    added: bool = True  # False: cancelled, nothing stored
    replaced: int = 0  # earlier versions of the file taken out of the library

    def line(self) -> str:
        if not self.added:
            return f"{self.document.name}: cancelled; nothing stored"
        if self.decoded == 0:
            how = "already read: its KV is on disk"
        else:
            how = f"read {self.decoded:,} tokens in {self.seconds:.1f} s"
            if self.restored:
                how += f" ({self.restored:,} restored from disk)"
        line = f"{self.document.name}: {self.tokens:,} tokens, {how}; kept in the library"
        if self.replaced:
            line += " in place of the earlier version (conversations keep what they read)"
        return line


def kv_label(type_k: str, type_v: str) -> str:
    return type_k if type_k == type_v else f"{type_k}/{type_v}"


def file_note(document: DocumentRow) -> str | None:
    """Whether the file a document was read from now differs (sha256), or is gone; None when
    it is the same or there is no path to look at."""
    if not document.source:
        return None
    source = Path(document.source)
    path = source / document.name if source.is_dir() else source
    try:
        raw = read_bytes(path, document.name, DEFAULT_BOUNDS.max_file_bytes)
    except DocumentError:
        return "gone from disk" if not path.exists() else "changed on disk"
    if hashlib.sha256(raw).hexdigest() != document.sha256:
        return "changed on disk"
    return None


class DocumentLibrary:
    """Keeps documents and their readings (see the module's docstring). Composed by the
    service like its other collaborators; the engine work runs on the caller's thread."""

    def __init__(
        self,
        host: EngineHost,
        store: Store,
        shelf: DocumentShelf,
        make_hot: Callable[..., RestoreResult],
    ) -> None:
        self.host = host
        self.store = store
        self.shelf = shelf
        # The pipeline's make_hot (loads the model, lets the last turn's housekeeping go,
        # spills the hot session): the reading takes the context like a turn does.
        self._make_hot = make_hot

    # --- what reads what ----------------------------------------------------------------

    def _engine(self) -> TokenEngine:
        """The engine that reads ahead: kvchat's own, whose KV the library keeps and pins
        (a llama-server's slot files and an OpenAI server's cache are not on kvchat's
        disk budget)."""
        engine = self.host.load().token_level()
        if engine is None or self.host.tiers is not self.host.local_tiers:
            raise KvchatError(
                "kvchat docs reads documents ahead with kvchat's own engine; with a server "
                "(--server, --openai) attach them with kvchat ask --new -a: with --server "
                "the first conversation saves their reading as a slot file"
            )
        return engine

    def model_key(self, engine: TokenEngine) -> tuple[str, str]:
        """(model file name, KV type) of the engine, as a reading records them."""
        config = engine.config
        return Path(config.model_path).name, kv_label(config.type_k, config.type_v)

    def plan(self, rows: Sequence[DocumentRow]) -> list[str]:
        """A line per document already read with another model or KV type only: the read
        that follows is another one (said before it starts)."""
        engine = self._engine()
        model, kv_type = self.model_key(engine)
        lines = []
        for row in rows:
            readings = self.store.library_readings(row.id)
            if readings and not any(r.model == model and r.kv_type == kv_type for r in readings):
                others = ", ".join(sorted({f"{r.model} ({r.kv_type} KV)" for r in readings}))
                lines.append(
                    f"{row.name} was read with {others}; {model} with {kv_type} KV means "
                    "another read"
                )
        return lines

    # --- adding ----------------------------------------------------------------------------

    def add(
        self,
        read: ReadDocuments,
        system_prompt: str | None = None,
        *,
        progress: ReadProgress | None = None,
        cancel: CancelCheck | None = None,
    ) -> list[ReadAhead]:
        """Keep each document and read it ahead (see the module's docstring). Every document
        is checked to fit before any is read; a cancel stops the read under way, and that
        document and those after it are not stored."""
        engine = self._engine()
        system = system_prompt or self.host.settings.system_prompt
        reserve = reply_reserve(self.host.settings.max_tokens, engine.n_ctx)
        heads = []
        for row in read.rows:
            head = system_message(system, render_block([as_document(row)]))
            self.shelf.fit(engine, head, reserve, None)  # one line when it does not fit
            heads.append(head)
        done: list[ReadAhead] = []
        for row, head in zip(read.rows, heads, strict=True):
            if cancel is not None and cancel():
                done.append(ReadAhead(row, "", 0, 0, 0, 0.0, added=False))
                continue
            result = self._read_one(engine, row, head, progress, cancel)
            if result.added:
                result = self._replace_earlier(result)
            done.append(result)
        return done

    def _replace_earlier(self, result: ReadAhead) -> ReadAhead:
        """Take earlier versions of the same file (same name and path, other content) out of
        the library: the new version replaces them (conversations keep what they read)."""
        new = result.document
        earlier = [
            doc
            for doc in self.store.documents(library=True)
            if doc.name == new.name and doc.source == new.source and doc.id != new.id
        ]
        for doc in earlier:
            self.store.remove_from_library(doc.id)
        return replace(result, replaced=len(earlier)) if earlier else result

    def _read_one(
        self,
        engine: TokenEngine,
        row: DocumentRow,
        head: list[dict[str, str]],
        progress: ReadProgress | None,
        cancel: CancelCheck | None,
    ) -> ReadAhead:
        shared = self.shelf.shared_end(engine, head)
        tokens = engine.chat_tokens([*head, {"role": "user", "content": _PROBE_QUESTION}])
        tokens = tokens[:shared]
        config = engine.config
        reading = reading_id(tokens, f"{config.model_path}|{config.type_k}|{config.type_v}")
        model, kv_type = self.model_key(engine)
        pin = LibraryReading(row.id, reading, model, kv_type, shared, "")
        started = time.perf_counter()
        tiers = self.host.tiers
        if tiers.snapshot(reading) is not None:
            self.store.add_to_library(row, pin)
            return ReadAhead(row, reading, shared, 0, 0, 0.0)
        restore = self._make_hot(reading, prompt=tokens)
        tiers.mark_hot(None)  # until it is whole: a cancelled read is never saved
        restored = engine.n_tokens if restore.source != "none" else 0
        watch = self._watch(row.name, engine, len(tokens), progress, cancel)
        prefill = engine.prefill(tokens, watch)
        if engine.n_tokens != len(tokens) or engine.tokens != tokens:
            return ReadAhead(row, reading, shared, 0, 0, 0.0, added=False)
        self.store.ensure_reading(reading, f"Reading of {row.name}")
        tiers.mark_hot(reading)
        tiers.mark_dirty()
        write = tiers.save_hot()
        if write.error:
            raise KvchatError(f"{row.name}: {write.error}; nothing stored")
        self.store.add_to_library(row, pin)
        seconds = time.perf_counter() - started
        return ReadAhead(row, reading, shared, prefill.decoded, restored, seconds)

    @staticmethod
    def _watch(
        name: str,
        engine: TokenEngine,
        total: int,
        progress: ReadProgress | None,
        cancel: CancelCheck | None,
    ) -> CancelCheck:
        """The prefill's check between batches: report how far it is, and stop on cancel."""
        started = time.perf_counter()
        base: int | None = None

        def check() -> bool:
            nonlocal base
            held = engine.n_tokens
            base = held if base is None else base
            if progress is not None:
                progress(name, held - base, total - base, time.perf_counter() - started)
            return cancel is not None and cancel()

        return check

    # --- listing and removing ---------------------------------------------------------------

    def entries(self) -> list[LibraryEntry]:
        """Every library document with its figures (no model is loaded for this)."""
        use = self.store.document_use()
        loaded = self.host.loaded
        engine = loaded.token_level() if loaded is not None else None
        now_key = self.model_key(engine) if engine is not None else None
        cold = self.host.local_tiers.cold
        entries = []
        for doc in self.store.documents(library=True):
            figures = tuple(
                ReadingFigures(
                    r.model,
                    r.kv_type,
                    r.tokens,
                    cold.snapshot_bytes(r.reading_id),
                    (r.model, r.kv_type) == now_key,
                )
                for r in self.store.library_readings(doc.id)
            )
            entries.append(LibraryEntry(doc, figures, use.get(doc.id, 0), file_note(doc)))
        return entries

    def find(self, ref: str) -> DocumentRow:
        """The library document a user named (name or id); one line when there is none."""
        found = self.store.library_document(ref)
        if found is None:
            raise KvchatError(f"no document {ref!r} in the library (see kvchat docs list)")
        return found

    def remove(self, ref: str) -> tuple[DocumentRow, list[str]]:
        """Take a document out of the library; its readings are no longer pinned (the disk
        budget may evict them like any snapshot). Conversations that used it keep its text.
        Returns the document and the readings un-pinned."""
        document = self.find(ref)
        return document, self.store.remove_from_library(document.id)

    def documents_for(self, refs: Sequence[str]) -> ReadDocuments:
        """The library documents named, as a new conversation starts with them."""
        rows = {row.id: row for row in (self.find(ref) for ref in refs)}
        # The block's canonical order (``canonical_order``: by name, then sha256).
        docs = sorted(rows.values(), key=lambda row: (row.name, row.sha256))
        return ReadDocuments(tuple(docs))


def reading_progress_line(name: str, done: int, total: int, seconds: float) -> str:
    """How far a document's read is, e.g. "reading valves.txt · 1,024 / 2,941 tokens ·
    ~9 s left"."""
    phrase = reading_phrase(done, total, seconds).removeprefix("reading the prompt · ")
    return f"reading {name} · {phrase}"
