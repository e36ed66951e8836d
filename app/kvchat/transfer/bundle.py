"""Portable session bundles: one zip with the text and, when there is one, the KV.

Members (names are kvchat's own; nothing else may be in the archive)::

    manifest.json    format, kvchat version, the KV's fingerprint, its exact token ids,
                     and the sha256 and size of every other member
    messages.json    the session as ``kvchat export --format json`` writes it, its
                     documents' text and placement included (an import restores them,
                     so the session's prompt, and so its KV, is the same)
    kv/000000.kvc …  the snapshot's chunk files, in token order (stored, not compressed)
    kv/state.kvs     or its whole-state blob file

Reading bounds everything before it is read: the central directory's size and entry
count (from the end record, before the zip module parses it), then every member's name,
size, compression method and ratio. Member names are looked up, never used as paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from kvchat import __version__
from kvchat.errors import KvchatError
from kvchat.kvcache.cold import bundle_files as bundle_io
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.system import current as current_system
from kvchat.transfer import kvchat_json
from kvchat.transfer.common import MAX_JSON_BYTES, BadFile, ImportedSession, load_json

if TYPE_CHECKING:
    from kvchat.service.chat import ChatService

FORMAT = "kvchat.bundle/1"
NAME = "kvchat bundle"
MANIFEST = "manifest.json"
MESSAGES = "messages.json"
MEMBER_NAME = re.compile(r"manifest\.json|messages\.json|kv/[0-9]{6}\.kvc|kv/state\.kvs")

MAX_MEMBERS = 20_000
MAX_CENTRAL_DIRECTORY = 4 << 20
MAX_MANIFEST_BYTES = 64 << 20
MAX_KV_MEMBER_BYTES = 2 << 30
MAX_BUNDLE_BYTES = 64 << 30
MAX_KV_TOKENS = 4 << 20
# A member that inflates more than this many times (and to over 1 MiB) is a zip bomb.
MAX_RATIO = 200
RATIO_FLOOR = 1 << 20


def matches(head: bytes) -> bool:
    return head.startswith((b"PK\x03\x04", b"PK\x05\x06"))


# --- writing ----------------------------------------------------------------------------------


@dataclass
class BundleWritten:
    """What ``kvchat export --format bundle`` wrote."""

    path: Path
    bytes: int  # the bundle file
    kv_tokens: int = 0
    kv_bytes: int = 0  # the session's KV state (what a restore loads)
    kv_member_bytes: int = 0  # the KV members as stored in the bundle
    reason: str | None = None  # why the bundle carries no KV


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _add(zf: zipfile.ZipFile, name: str, data: Any, compress: bool) -> dict[str, Any]:
    info = zipfile.ZipInfo(name, time.gmtime()[:6])
    info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    info.external_attr = 0o600 << 16
    zf.writestr(info, data)
    return {"sha256": _sha256(data), "size": len(data)}


def _kv_name(row_format: str, number: int) -> str:
    return f"kv/{number:06d}.kvc" if row_format == "chunks" else "kv/state.kvs"


def write_bundle(service: ChatService, session_id: str, output: Path) -> BundleWritten:
    """Write ``session_id`` as a bundle at ``output`` (atomically: a temp file renamed).

    The KV is the session's own snapshot on disk (the hot session's is saved first); a
    session without one, or whose snapshot fails its checks, gets a text-only bundle and
    the reason. Written under the session's turn lock, like a turn.
    """
    with service.sessions.holding(
        session_id
    ):  # never a reply still streaming, nor its KV half-saved
        return _write_bundle(service, session_id, output)


def _write_bundle(service: ChatService, session_id: str, output: Path) -> BundleWritten:
    tiers = service.host.tiers
    if tiers.hot_session_id == session_id and tiers.dirty:
        tiers.save_hot()
    session = service.imports.session(session_id)
    text = service.sessions.export(session_id, "json").encode("utf-8")
    snapshots = tiers.cold
    result = BundleWritten(output, 0)
    row = None
    try:
        row = bundle_io.own_snapshot(snapshots, session_id)
        for _ in bundle_io.snapshot_files(snapshots, row):
            pass  # every file checks out before any goes in
    except SnapshotRejected as exc:
        row, result.reason = None, exc.reason
    except OSError as exc:
        row, result.reason = None, f"the session's KV cannot be read ({exc})"
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        fd = current_system().open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError as exc:
        raise KvchatError(f"cannot write {output}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            with zipfile.ZipFile(fh, "w", allowZip64=True) as zf:
                members = {MESSAGES: _add(zf, MESSAGES, text, compress=True)}
                kv: dict[str, Any] | None = None
                if row is not None:
                    files = []
                    for number, item in enumerate(bundle_io.snapshot_files(snapshots, row)):
                        name = _kv_name(row.format, number)
                        members[name] = _add(zf, name, item.data, compress=False)
                        files.append(
                            {"member": name, "start": item.start, "n_tokens": item.n_tokens}
                        )
                        result.kv_member_bytes += members[name]["size"]
                    kv = {
                        "format": row.format,
                        "fingerprint": row.fingerprint,
                        "n_tokens": row.n_tokens,
                        "token_ids": row.token_ids,
                        "state_bytes": row.n_bytes,
                        "layout": row.layout,
                        "files": files,
                    }
                    result.kv_tokens, result.kv_bytes = row.n_tokens, row.n_bytes
                manifest = {
                    "format": FORMAT,
                    "kvchat_version": __version__,
                    "session": {"id": session.id, "title": session.title},
                    "members": members,
                    "kv": kv,
                    "kv_note": result.reason,
                }
                _add(zf, MANIFEST, json.dumps(manifest).encode(), compress=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, output)
    except SnapshotRejected as exc:
        raise KvchatError(
            f"the session's KV changed while it was exported ({exc.reason}); try again"
        ) from None
    except OSError as exc:
        raise KvchatError(f"cannot write {output}: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    result.bytes = output.stat().st_size
    return result


# --- reading ----------------------------------------------------------------------------------


@dataclass
class BundleKV:
    """The manifest's KV section, checked for shape (its bytes are checked when installed)."""

    format: str
    fingerprint: dict[str, Any]
    tokens: list[int]
    layout: dict[str, Any] | None
    files: list[tuple[str, int, int]]  # (member, start, n_tokens), in token order


@dataclass
class Bundle:
    """An open bundle: its session's text, its KV section, and member reads by name."""

    path: Path
    zf: zipfile.ZipFile
    members: dict[str, zipfile.ZipInfo]
    hashes: dict[str, str]
    sessions: list[ImportedSession] = field(default_factory=list)
    kv: BundleKV | None = None
    kv_reason: str | None = None
    sha256: str = ""  # the file's (set by the importer): names the KV's origin

    def read_kv(self, name: str) -> bytes:
        """A KV member's bytes, checked against the manifest's sha256 (else SnapshotRejected)."""
        try:
            data = _read(self.zf, self.members[name], MAX_KV_MEMBER_BYTES)
        except _Unreadable as exc:
            raise SnapshotRejected(f"{name} is corrupt ({exc})") from None
        if _sha256(data) != self.hashes[name]:
            raise SnapshotRejected(f"{name} fails its sha256 check: the KV is corrupt")
        return data


class _Unreadable(Exception):
    pass


def _read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """A member's bytes, never more than ``limit`` (the zip's CRC checked by the zip module)."""
    try:
        with zf.open(info) as member:
            data = member.read(min(info.file_size, limit) + 1)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise _Unreadable(str(exc) or type(exc).__name__) from None
    if len(data) != info.file_size:
        raise _Unreadable(f"{len(data)} bytes where the archive says {info.file_size}")
    return data


def _central_directory(fh: BinaryIO, size: int) -> tuple[int, int]:
    """(entries, bytes) of the central directory, from the end record (zip64 included)."""
    span = min(size, 22 + 0xFFFF)
    fh.seek(size - span)
    tail = fh.read(span)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise ValueError("no end-of-archive record")
    entries, cd_bytes, cd_offset = struct.unpack_from("<HLL", tail, at + 10)
    if 0xFFFF not in (entries,) and 0xFFFFFFFF not in (cd_bytes, cd_offset):
        return entries, cd_bytes
    if at < 20 or tail[at - 20 : at - 16] != b"PK\x06\x07":
        raise ValueError("a zip64 end record without its locator")
    (record_at,) = struct.unpack_from("<Q", tail, at - 12)
    if record_at > size - 56:
        raise ValueError("the zip64 end record lies outside the file")
    fh.seek(record_at)
    record = fh.read(56)
    if record[:4] != b"PK\x06\x06":
        raise ValueError("no zip64 end record")
    entries, cd_bytes = struct.unpack_from("<QQ", record, 32)
    return entries, cd_bytes


def _check_members(path: Path, zf: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise BadFile(path, f"the archive holds {len(infos):,} members (at most {MAX_MEMBERS:,})")
    members: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in infos:
        name = info.filename
        if MEMBER_NAME.fullmatch(name) is None:
            raise BadFile(path, f"the archive holds a member kvchat does not write: {name[:80]!r}")
        if name in members:
            raise BadFile(path, f"the archive holds two members named {name!r}")
        if info.flag_bits & 0x1:
            raise BadFile(path, f"{name} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise BadFile(path, f"{name} uses a compression method kvchat does not write")
        limit = MAX_KV_MEMBER_BYTES if name.startswith("kv/") else MAX_JSON_BYTES
        if name == MANIFEST:
            limit = MAX_MANIFEST_BYTES
        if info.file_size > limit:
            raise BadFile(
                path,
                f"{name} would unpack to {info.file_size:,} bytes (at most {limit:,}): refused",
            )
        if info.file_size > RATIO_FLOOR and info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise BadFile(
                path,
                f"{name} would unpack {info.file_size:,} bytes from {info.compress_size:,} "
                f"(a zip bomb?): refused",
            )
        total += info.file_size
        members[name] = info
    if total > MAX_BUNDLE_BYTES:
        raise BadFile(path, f"the archive would unpack to {total:,} bytes: refused")
    for needed in (MANIFEST, MESSAGES):
        if needed not in members:
            raise BadFile(path, f"not a kvchat bundle (no {needed})")
    return members


def _manifest(path: Path, zf: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo]) -> Any:
    try:
        raw = _read(zf, members[MANIFEST], MAX_MANIFEST_BYTES)
    except _Unreadable as exc:
        raise BadFile(path, f"{MANIFEST} is corrupt ({exc})") from None
    manifest = load_json(path, raw, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BadFile(path, f"not a kvchat bundle ({MANIFEST} is not a {FORMAT} manifest)")
    listed = manifest.get("members")
    if not isinstance(listed, dict):
        raise BadFile(path, f"{MANIFEST} has no member list")
    for name, info in members.items():
        if name == MANIFEST:
            continue
        entry = listed.get(name)
        if not isinstance(entry, dict):
            raise BadFile(path, f"{name} is in the archive but not in its manifest")
        digest, size = entry.get("sha256"), entry.get("size")
        if not isinstance(digest, str) or re.fullmatch(r"[0-9a-f]{64}", digest) is None:
            raise BadFile(path, f"{MANIFEST} has no sha256 for {name}")
        if size != info.file_size:
            raise BadFile(
                path, f"{name} holds {info.file_size:,} bytes, its manifest says {size!r}"
            )
    missing = sorted(set(listed) - set(members))
    if missing:
        raise BadFile(path, f"{MANIFEST} lists {missing[0]!r}, which the archive does not hold")
    return manifest


def _is_count(value: object, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def _kv_section(manifest: dict[str, Any], members: dict[str, zipfile.ZipInfo]) -> BundleKV:
    """The manifest's KV section; raises SnapshotRejected (text-only import) when malformed."""
    kv = manifest["kv"]
    bad = SnapshotRejected
    if not isinstance(kv, dict):
        raise bad("the manifest's KV section is not an object")
    kind, fingerprint, tokens = kv.get("format"), kv.get("fingerprint"), kv.get("token_ids")
    if kind not in ("chunks", "blob"):
        raise bad(f"the manifest's KV format {str(kind)[:20]!r} is not one kvchat writes")
    if not isinstance(fingerprint, dict):
        raise bad("the manifest's KV has no fingerprint")
    if (
        not isinstance(tokens, list)
        or not 0 < len(tokens) <= MAX_KV_TOKENS
        or kv.get("n_tokens") != len(tokens)
        or not all(
            isinstance(t, int) and not isinstance(t, bool) and -(2**31) <= t < 2**31 for t in tokens
        )
    ):
        raise bad("the manifest's token ids are damaged")
    files = kv.get("files")
    if not isinstance(files, list) or not files or (kind == "blob" and len(files) != 1):
        raise bad("the manifest's KV file list is damaged")
    out: list[tuple[str, int, int]] = []
    for entry in files:
        name = entry.get("member") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or name not in members
            or not name.startswith("kv/")
            or not _is_count(entry.get("start"), MAX_KV_TOKENS)
            or not _is_count(entry.get("n_tokens"), MAX_KV_TOKENS)
        ):
            raise bad("the manifest's KV file list is damaged")
        out.append((name, entry["start"], entry["n_tokens"]))
    if len({name for name, _, _ in out}) != len(out):
        raise bad("the manifest lists a KV file twice")
    layout = kv.get("layout")
    if kind == "chunks" and not isinstance(layout, dict):
        raise bad("the manifest's chunked KV has no layout")
    return BundleKV(kind, fingerprint, tokens, layout if kind == "chunks" else None, out)


@contextmanager
def open_bundle(path: Path, fh: BinaryIO, size: int) -> Iterator[Bundle]:
    """Check and open the bundle in ``fh``; raises :class:`BadFile` for one kvchat can't
    import at all (a KV problem only leaves ``kv`` None, with ``kv_reason``)."""
    try:
        entries, cd_bytes = _central_directory(fh, size)
    except (ValueError, struct.error, OSError) as exc:
        raise BadFile(path, f"not a readable zip archive ({exc})") from None
    if entries > MAX_MEMBERS or cd_bytes > MAX_CENTRAL_DIRECTORY:
        raise BadFile(path, f"the archive lists {entries:,} members in {cd_bytes:,} bytes: refused")
    fh.seek(0)
    try:
        zf = zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise BadFile(path, f"not a readable zip archive ({exc})") from None
    with zf:
        members = _check_members(path, zf)
        manifest = _manifest(path, zf, members)
        hashes = {name: entry["sha256"] for name, entry in manifest["members"].items()}
        try:
            raw = _read(zf, members[MESSAGES], MAX_JSON_BYTES)
        except _Unreadable as exc:
            raise BadFile(path, f"{MESSAGES} is corrupt ({exc})") from None
        if _sha256(raw) != hashes[MESSAGES]:
            raise BadFile(path, f"{MESSAGES} fails its sha256 check: the bundle is corrupt")
        inner = Path(f"{path}:{MESSAGES}")
        document = load_json(inner, raw)
        if not kvchat_json.matches(document):
            raise BadFile(path, f"{MESSAGES} is not a kvchat session export")
        bundle = Bundle(path, zf, members, hashes, kvchat_json.read(inner, document))
        if manifest.get("kv") is None:
            note = manifest.get("kv_note")
            bundle.kv_reason = "the bundle carries no KV" + (
                f" ({note[:200]})" if isinstance(note, str) and note else ""
            )
        else:
            try:
                bundle.kv = _kv_section(manifest, members)
            except SnapshotRejected as exc:
                bundle.kv_reason = exc.reason
        yield bundle
