"""``kvchat import``: recognise a file, read it with its format's module, store it.

Every session a file holds goes in with one store transaction (a bad file imports
nothing). A file is recognised by its contents, not its name: a zip is a bundle, an
SQLite database an llm ``logs.db``, anything else JSON (kvchat's export, a ChatGPT
``conversations.json``, OpenAI-style messages). The file's sha256 is recorded in the
store's ``meta`` table (``import:<sha256>`` → session ids), so the same file imported again
is reported, not duplicated; a conversation from a re-exported archive that is already
here, unchanged, is reported the same way. Import never overwrites a session.

A bundle's KV is installed after its text commits, and only when the manifest's
fingerprint matches this machine's model and settings, every hash checks, and its first
chunk recomputed here matches it (:mod:`kvchat.kvcache.state.recompute`); otherwise the session
has its text and ``kv_reason`` says why. Installed KV keeps the bundle's origin (the
file's sha256) in its fingerprint: only sessions from that file (and their whole forks)
ever load it, and nothing computed here shares its chunks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.kvcache.cold import bundle_files as bundle_io
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state.recompute import FirstChunkCheck
from kvchat.transfer import bundle, chatgpt, common, kvchat_json, llm_logs, openai
from kvchat.transfer.common import (
    MAX_JSON_BYTES,
    BadFile,
    ImportedSession,
    load_json,
)
from kvchat.transfer.json_stream import ArrayReader

if TYPE_CHECKING:
    from kvchat.service.chat import ChatService

FILE_KEY = "import:{}"
SESSION_KEY = "import:session:{}"
# What `kvchat import` reads, in words (for the line that refuses anything else).
FORMATS_READ = (
    "a kvchat JSON export or bundle, OpenAI-style messages, a ChatGPT conversations.json "
    "or an llm logs.db"
)
# Readers of JSON documents, tried in this order.
JSON_FORMATS: list[
    tuple[str, Callable[[object], bool], Callable[[Path, Any], list[ImportedSession]]]
] = [
    (kvchat_json.NAME, kvchat_json.matches, kvchat_json.read),
    (chatgpt.NAME, chatgpt.matches, chatgpt.read),
    (openai.NAME, openai.matches, openai.read),
]


@dataclass
class SessionImport:
    """One session a file brought (or would have brought, when it was here already)."""

    session: str
    title: str
    messages: int
    new: bool
    kv_tokens: int = 0
    kv_reason: str | None = None
    skipped: int = 0
    # Installed KV: where it came from, and what recomputing its first cells showed.
    kv_origin: str | None = None
    kv_check: FirstChunkCheck | None = None
    documents: int = 0  # the documents it came with (placed as they were)

    def to_json(self) -> dict[str, Any]:
        check = self.kv_check
        return {
            "session": self.session,
            "title": self.title,
            "messages": self.messages,
            "kv": {
                "tokens": self.kv_tokens,
                "reason": self.kv_reason,
                "origin": self.kv_origin,
                "check": None
                if check is None
                else {"tokens": check.tokens, "ms": round(check.ms, 1), "worst": check.worst},
            },
            "already_imported": not self.new,
            "skipped": self.skipped,
            "documents": self.documents,
        }


@dataclass
class FileImport:
    """What importing one file did."""

    path: str
    format: str
    sha256: str
    sessions: list[SessionImport] = field(default_factory=list)
    # Set when this very file was imported before (its sessions are those, not new ones).
    already: bool = False
    # Conversations left out because nothing in them is text (images, tool calls, nulls).
    empty: int = 0


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BadFile(path, f"cannot be read ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    if stat.S_ISDIR(info.st_mode):
        os.close(fd)
        raise BadFile(path, f"is a directory: name the files in it (kvchat import {path}/*)")
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise BadFile(path, "not a regular file")
    return fd, info


def _sha256_of(fh: Any) -> str:
    digest = hashlib.sha256()
    fh.seek(0)
    while block := fh.read(1 << 20):
        digest.update(block)
    fh.seek(0)
    return digest.hexdigest()


def _session_key(fmt: str, session: ImportedSession) -> str | None:
    """A meta key naming this conversation's content, for sources that have ids."""
    if session.source_key is None:
        return None
    content = [
        fmt,
        session.source_key,
        session.title,
        session.system_prompt,
        [[m.role, m.content, m.partial] for m in session.messages],
    ]
    if session.documents:  # a conversation with other documents is another conversation
        content.append([[d.name, d.sha256, d.message, d.text] for d in session.documents])
    if session.summaries:  # and so is one the model reads through another summary
        content.append([list(summary) for summary in session.summaries])
    digest = hashlib.sha256(json.dumps(content, ensure_ascii=False).encode("utf-8"))
    return SESSION_KEY.format(digest.hexdigest())


@dataclass(frozen=True)
class ImportProgress:
    """How far an import has got: bytes of the file read, sessions and messages so far."""

    bytes_done: int
    bytes_total: int
    sessions: int
    messages: int


Progress = Callable[[ImportProgress], None]


def _store_sessions(
    service: ChatService,
    result: FileImport,
    sessions: Iterable[ImportedSession],
    *,
    progress: Progress | None = None,
    bytes_done: Callable[[], int] | None = None,
    total: int = 0,
) -> None:
    """Store ``sessions`` as they come, in one transaction (a bad one anywhere stores none):
    memory holds one session at a time, and a short record of each one stored."""
    path = Path(result.path)
    # Per session stored: title, messages, skipped, documents.
    kept: list[tuple[str, int, int, int]] = []
    counts = {"sessions": 0, "messages": 0, "left": 0}

    def items() -> Iterator[dict[str, Any]]:
        for s in sessions:
            counts["sessions"] += 1
            counts["messages"] += len(s.messages)
            if counts["sessions"] > common.MAX_SESSIONS:
                raise BadFile(
                    path, f"more than {common.MAX_SESSIONS:,} conversations is over the limit"
                )
            if counts["messages"] > common.MAX_MESSAGES:
                raise BadFile(path, f"more than {common.MAX_MESSAGES:,} messages is over the limit")
            if not s.messages:
                result.empty += 1
                counts["left"] += s.skipped
                continue
            yield {
                "title": s.title,
                "system_prompt": s.system_prompt,
                "settings": s.settings,
                "created": s.created,
                "updated": s.updated,
                "messages": [
                    (m.role, m.content, m.created, m.token_count, m.partial, m.reasoning)
                    for m in s.messages
                ],
                "documents": [tuple(d) for d in s.documents],
                # (message index, text, replaced tokens) of its compaction summaries
                "summaries": [tuple(summary) for summary in s.summaries],
                # (message index, tool, calls) of its tool messages and replies that called
                "tools": [
                    (i, None if m.tool is None else tuple(m.tool), m.calls)
                    for i, m in enumerate(s.messages)
                    if m.tool is not None or m.calls
                ],
                "key": _session_key(result.format, s),
            }
            kept.append((s.title, len(s.messages), s.skipped, len(s.documents)))
            if progress is not None:
                done = bytes_done() if bytes_done is not None else total
                progress(ImportProgress(done, total, len(kept), counts["messages"]))
        if counts["sessions"] and not kept:
            left = counts["left"]
            raise BadFile(
                path,
                "holds no text to import"
                + (f" ({left} parts left out: images, tool calls, empty messages)" if left else ""),
            )

    stored = service.imports.store_sessions(items(), FILE_KEY.format(result.sha256))
    for (title, n_messages, skipped, documents), (session_id, new) in zip(kept, stored):
        result.sessions.append(
            SessionImport(session_id, title, n_messages, new, skipped=skipped, documents=documents)
        )


def _chatgpt_stream(path: Path, fh: Any) -> tuple[ArrayReader, Iterator[Any]] | None:
    """A ChatGPT ``conversations.json`` (a list whose first element is a conversation),
    read one conversation at a time; None for any other JSON (read whole, as before)."""
    reader = ArrayReader(path, fh, max_element=MAX_JSON_BYTES)
    try:
        if not reader.is_array():
            return None
        elements = iter(reader)
        first = next(elements, None)
    except BadFile as exc:  # a Markdown file, a PDF: say what kvchat does read
        raise BadFile(path, f"{exc.reason}; kvchat imports {FORMATS_READ}") from None
    if not chatgpt.first_matches(first):
        return None
    return reader, itertools.chain([first], elements)


def _some(path: Path, sessions: Iterable[ImportedSession]) -> Iterator[ImportedSession]:
    """``sessions``, and BadFile at their end when there were none."""
    found = False
    for session in sessions:
        found = True
        yield session
    if not found:
        raise BadFile(path, chatgpt.NO_CONVERSATION)


def _already(service: ChatService, result: FileImport, ids: list[str]) -> FileImport:
    result.already = True
    for session_id in ids:
        stored = service.imports.stored(session_id)
        result.sessions.append(
            SessionImport(
                session_id,
                stored.session.title,
                stored.messages,
                new=False,
                kv_tokens=stored.kv_tokens,
                kv_reason="this file was imported before",
            )
        )
    return result


def bundle_origin(sha256: str) -> str:
    """The origin KV from the file with this sha256 keeps (see ``Fingerprint.origin``)."""
    return f"bundle:{sha256[:32]}"


def _install_kv(service: ChatService, opened: bundle.Bundle, item: SessionImport) -> None:
    """Install the bundle's KV as ``item``'s session's snapshot, in the file's own trust
    domain; sets ``item.kv_tokens`` (and the origin and check), or ``item.kv_reason``."""
    kv = opened.kv
    if kv is None:
        item.kv_reason = opened.kv_reason or "the bundle carries no KV"
        return
    try:
        fingerprint = service.host.fingerprint
        engine = service.engine
    except KvchatError as exc:
        item.kv_reason = f"no model to check the KV against ({exc})"
        return
    mismatch = fingerprint.mismatch(kv.fingerprint)
    if mismatch is not None:
        item.kv_reason = f"the KV does not fit this model and settings: {mismatch}"
        return
    if not engine.capabilities.seq_state:
        item.kv_reason = "this engine cannot restore saved KV"
        return
    origin = bundle_origin(opened.sha256)
    fingerprint = fingerprint.with_origin(origin)
    service.host.tiers.spill()  # the check's prefill uses the context: the hot session is kept
    snapshots = service.host.tiers.cold
    try:
        if kv.format == "chunks":
            assert kv.layout is not None
            chunks = [
                bundle_io.IncomingChunk(start, n, lambda name=name: opened.read_kv(name))
                for name, start, n in kv.files
            ]
            row, check = bundle_io.install_chunks(
                snapshots,
                item.session,
                fingerprint,
                engine.kv_shape(),
                kv.tokens,
                kv.layout,
                chunks,
                engine,
            )
        else:
            name = kv.files[0][0]
            row, check = bundle_io.install_blob(
                snapshots,
                item.session,
                fingerprint,
                kv.tokens,
                lambda: opened.read_kv(name),
                engine,
                engine.kv_shape(),
            )
    except SnapshotRejected as exc:
        item.kv_reason = exc.reason
        return
    except OSError as exc:
        item.kv_reason = f"could not write the KV ({exc})"
        return
    item.kv_tokens, item.kv_origin, item.kv_check = row.n_tokens, origin, check


def import_file(
    service: ChatService, path: Path, *, kv: bool = True, progress: Progress | None = None
) -> FileImport:
    """Import every session in ``path``; raises :class:`BadFile` (a KvchatError naming the
    file, one line) for a file that can't be imported, having stored nothing from it.

    ``kv=False`` takes only the text of a bundle (its KV is as trustworthy as its maker).
    A ChatGPT ``conversations.json`` of any size is read one conversation at a time;
    ``progress`` hears after each session stored.
    """
    fd, info = _open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        head = fh.read(16)
        if bundle.matches(head):
            fmt = bundle.NAME
        elif head.startswith(llm_logs.MAGIC):
            fmt = llm_logs.NAME
        else:
            fmt = "JSON"
        result = FileImport(str(path), fmt, _sha256_of(fh))
        earlier = service.imports.claimed(FILE_KEY.format(result.sha256))
        if earlier:
            return _already(service, result, earlier)
        if fmt == bundle.NAME:
            with bundle.open_bundle(path, fh, info.st_size) as opened:
                opened.sha256 = result.sha256
                _store_sessions(service, result, opened.sessions)
                for item in result.sessions:
                    if item.new and not kv:
                        item.kv_reason = "text only was asked for (--no-kv)"
                    elif item.new:
                        _install_kv(service, opened, item)
                    else:
                        item.kv_reason = "this conversation was imported before"
            return result
        stream = None if fmt == llm_logs.NAME else _chatgpt_stream(path, fh)
        if stream is not None:
            reader, conversations = stream
            result.format = chatgpt.NAME
            _store_sessions(
                service,
                result,
                _some(path, chatgpt.sessions(path, conversations)),
                progress=progress,
                bytes_done=lambda: reader.bytes_done,
                total=info.st_size,
            )
            _kv_reasons(result, f"{chatgpt.NAME} carries no KV")
            return result
        if fmt == llm_logs.NAME:
            sessions = llm_logs.read(path)
            reason = f"{llm_logs.NAME} carries no KV"
        else:
            if info.st_size > MAX_JSON_BYTES:
                raise BadFile(
                    path, f"{info.st_size:,} bytes is over the {MAX_JSON_BYTES:,}-byte JSON limit"
                )
            fh.seek(0)
            try:
                document = load_json(path, fh.read(MAX_JSON_BYTES + 1))
            except BadFile as exc:  # a Markdown file, a PDF: say what kvchat does read
                raise BadFile(path, f"{exc.reason}; kvchat imports {FORMATS_READ}") from None
            for name, matches, read in JSON_FORMATS:
                if matches(document):
                    result.format = name
                    sessions = read(path, document)
                    break
            else:
                raise BadFile(path, f"not a format kvchat imports ({FORMATS_READ})")
            reason = f"{result.format} carries no KV"
    _store_sessions(service, result, sessions, progress=progress, total=info.st_size)
    _kv_reasons(result, reason)
    return result


def _kv_reasons(result: FileImport, reason: str) -> None:
    for item in result.sessions:
        item.kv_reason = reason if item.new else "this conversation was imported before"
