"""Fault classes as campaigns: index damage, damaged files salvaged, deep
nesting, a WAL beside a damaged file, forged bundles, a full disk at every write of a turn.

The default run is sized for CI (seconds per class, forged bundles and the full disk a
few cases each with the real model); ``pytest -m stress`` runs every class by the
thousand (``KVCHAT_STRESS_CASES``, default 1,000). Each case asserts what a user would
notice: a history is whole or refused as damage, never shorter; salvaged text is what was
written; an import is done or refused on one line; a damaged file and its WAL are left as
they were; a session made here answers as a full prefill would; what kvchat says of a
reply is what the database holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sqlite3
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvchat.errors import KvchatError
from kvchat.store import Store
from kvchat.store import integrity as doctor
from kvchat.store import store as store_module
from kvchat.store.store import DamagedDatabase, StoreFull

STRESS_CASES = int(os.environ.get("KVCHAT_STRESS_CASES", "1000"))


# --- index damage ------------------------------------------------------------------------------


def _index_home(path: Path, rng: random.Random) -> dict[str, list[str]]:
    store = Store(path)
    texts: dict[str, list[str]] = {}
    for _ in range(rng.randint(1, 4)):
        session = store.create_session("s")
        texts[session.id] = []
        for i in range(rng.randint(0, 8)):
            text = f"m{i} " + "x" * rng.randint(1, 300)
            store.add_message(session.id, ("user", "assistant")[i % 2], text, token_count=i)
            texts[session.id].append(text)
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return texts


def _damage_an_index(path: Path, rng: random.Random, session_ids: list[str]) -> bool:
    """Flip one byte of a session id inside an index page; False when none is there."""
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    names = ["idx_messages_session_id_id", "sqlite_autoindex_sessions_1"]
    roots = [
        db.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (n,)).fetchone()[0]
        for n in names
    ]
    db.close()
    data = bytearray(path.read_bytes())
    root = rng.choice(roots)
    start = (root - 1) * page_size
    page = bytes(data[start : start + page_size])
    spots = [
        start + at + rng.randrange(8) for sid in session_ids for at in _finds(page, sid.encode())
    ]
    if not spots:
        return False
    data[rng.choice(spots)] ^= 1 << rng.randrange(7)
    path.write_bytes(bytes(data))
    return True


def _finds(page: bytes, needle: bytes) -> Iterator[int]:
    at = page.find(needle)
    while at != -1:
        yield at
        at = page.find(needle, at + 1)


def _index_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    tally = {"cases": 0, "refused_at_open": 0, "refused_history": 0, "whole_history": 0}
    case = -1
    while tally["cases"] < n:  # a home whose index page names no session is no case
        case += 1
        path = tmp_path / f"idx{case}" / "kvchat.db"
        texts = _index_home(path, rng)
        if not _damage_an_index(path, rng, list(texts)):
            shutil.rmtree(path.parent)
            continue
        tally["cases"] += 1
        before = path.read_bytes()
        try:
            store = Store(path)
        except DamagedDatabase:
            tally["refused_at_open"] += 1
        else:
            try:
                for session_id, expected in texts.items():
                    try:
                        got = [m.content for m in store.messages(session_id)]
                    except DamagedDatabase:
                        tally["refused_history"] += 1
                        continue
                    assert got == expected, (case, session_id)  # whole, never shorter
                    tally["whole_history"] += 1
                assert store.wait_for_check(60) is not None, case  # the full check sees it
                with pytest.raises(DamagedDatabase, match="kvchat doctor"):
                    store.add_message(next(iter(texts)), "user", "more")
            finally:
                store.close()
        assert path.read_bytes() == before, case
        shutil.rmtree(path.parent)
    return tally


@pytest.fixture
def background_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "FULL_CHECK_AT_OPEN_BYTES", 0)


def test_index_damage_campaign(tmp_path: Path, background_check):
    tally = _index_cases(tmp_path, n=30, seed=1)
    assert tally["cases"] == 30 and tally["refused_history"] + tally["refused_at_open"] > 0


@pytest.mark.stress
def test_stress_index_damage(tmp_path: Path, background_check):
    tally = _index_cases(tmp_path, n=STRESS_CASES, seed=11)
    print(f"\nSTRESS index damage: {tally}")


# --- damaged files salvaged --------------------------------------------------------------------


def _salvage_home(path: Path, rng: random.Random) -> dict[int, tuple[str, str]]:
    store = Store(path)
    texts: dict[int, tuple[str, str]] = {}
    for _ in range(rng.randint(1, 6)):
        session = store.create_session("s")
        for i in range(rng.randint(1, 12)):
            text = f"{session.id} {i} " + "word " * rng.choice([5, 50, 900, 3000])
            message = store.add_message(session.id, ("user", "assistant")[i % 2], text)
            texts[message.id] = (session.id, text)
    store.close()
    if rng.random() < 0.7:  # else the last writes stay in the WAL beside the file
        db = sqlite3.connect(path)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
    return texts


def _damage_file(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    how = rng.choice(["truncate", "header", "pages", "bytes"])
    if how == "truncate":
        del data[rng.randrange(len(data)) :]
    elif how == "header":
        data[: rng.randint(1, 100)] = os.urandom(rng.randint(1, 100))
    elif how == "pages":
        for _ in range(rng.randint(1, 5)):
            page = rng.randrange(max(len(data) // 4096, 1))
            data[page * 4096 : (page + 1) * 4096] = os.urandom(4096)
    else:  # bytes changed in place: SQLite keeps no checksum, text read may carry them
        for _ in range(rng.randint(1, 50)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return how


def _same_text(salvaged: str, written: str, how: str) -> bool:
    """The text written; after bytes changed in place, the same text but for at most those
    bytes (what SQLite itself reads back), never text from elsewhere."""
    if salvaged == written:
        return True
    if how != "bytes" or len(salvaged) != len(written):
        return False
    return sum(a != b for a, b in zip(salvaged, written)) <= 50


def _salvage_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    tally = {"cases": 0, "sound": 0, "messages_written": 0, "messages_salvaged": 0}
    for case in range(n):
        path = tmp_path / f"s{case}" / "kvchat.db"
        texts = _salvage_home(path, rng)
        how = _damage_file(path, rng)
        tally["cases"] += 1
        tally["messages_written"] += len(texts)
        if doctor.check(path).ok:
            tally["sound"] += 1  # the damage missed every page in use
            shutil.rmtree(path.parent)
            continue
        report = doctor.salvage(path)
        store = Store(path)
        try:
            rows = store._rows("SELECT id, session_id, content FROM messages")
        finally:
            store.close()
        for row in rows:  # salvaged text is the text written, in its own session
            written = texts.get(row["id"])
            if written is not None and _same_text(row["content"], written[1], how):
                assert row["session_id"] == written[0] or how == "bytes", case
                continue
            # Bytes changed in place can change a row's id or session id (SQLite reads
            # them as they now are): its text must still be one that was written.
            assert how == "bytes", (case, how, row["id"])
            assert any(_same_text(row["content"], text, how) for _, text in texts.values()), (
                case,
                row["id"],
            )
        assert report.messages == len(rows), case
        tally["messages_salvaged"] += len(rows)
        assert doctor.check(path).ok, case
        shutil.rmtree(path.parent)
    return tally


def test_salvage_campaign(tmp_path: Path):
    tally = _salvage_cases(tmp_path, n=25, seed=2)
    assert tally["messages_salvaged"] > 0


@pytest.mark.stress
def test_stress_salvage(tmp_path: Path):
    tally = _salvage_cases(tmp_path, n=STRESS_CASES, seed=12)
    print(f"\nSTRESS salvage: {tally}")


# --- deep nesting -------------------------------------------------------------------------------


def _nested(rng: random.Random) -> str:
    depth = rng.choice([rng.randint(1, 120), rng.randint(100, 200_000)])
    opens = "".join(rng.choice("[{") for _ in range(depth))
    body = '"a[{"'
    text = ""
    for bracket in opens:
        text += bracket if bracket == "[" else bracket + '"k": '
    text += body
    if rng.random() < 0.8:  # else left open
        text += "".join("]" if b == "[" else "}" for b in reversed(opens))
    if rng.random() < 0.5:
        text = (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "extra": None})[:-1]
            + f', "deep": {text}}}'
        )
    return text


def _nesting_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    from kvchat.config import load_settings
    from kvchat.service.chat import open_service
    from kvchat.transfer import BadFile, import_file

    rng = random.Random(seed)
    tally = {"cases": 0, "refused": 0, "imported": 0}
    with open_service(load_settings(), home=tmp_path / "home") as service:
        for case in range(n):
            path = tmp_path / f"deep{case}.json"
            path.write_text(_nested(rng))
            tally["cases"] += 1
            try:
                import_file(service, path)
                tally["imported"] += 1
            except BadFile as exc:
                assert "\n" not in str(exc) and str(exc).startswith(str(path)), case
                tally["refused"] += 1
            path.unlink()
    return tally


def test_deep_nesting_campaign(tmp_path: Path, kvhome: Path):
    tally = _nesting_cases(tmp_path, n=40, seed=3)
    assert tally["refused"] > 0


@pytest.mark.stress
def test_stress_deep_nesting(tmp_path: Path, kvhome: Path):
    tally = _nesting_cases(tmp_path, n=STRESS_CASES, seed=13)
    print(f"\nSTRESS deep nesting: {tally}")


# --- a WAL beside a damaged file ---------------------------------------------------------------


def _wal_source(tmp_path: Path) -> Path:
    """A database whose last writes are only in its WAL (a copy taken while a writer held
    it open), the files kept as a template."""
    source = tmp_path / "live.db"
    store = Store(source)
    session = store.create_session("s")
    for i in range(60):
        store.add_message(session.id, "user", f"m{i} " + "y" * 500)
    store.close()
    db = sqlite3.connect(source)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    writer = sqlite3.connect(source)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    with writer:
        writer.execute("UPDATE sessions SET title='in the WAL'")
    template = tmp_path / "template"
    template.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copyfile(f"{source}{suffix}", template / f"kvchat.db{suffix}")
    writer.close()
    return template


def _wal_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    template = _wal_source(tmp_path)
    tally = {"cases": 0, "refused": 0, "opened": 0}
    for case in range(n):
        home = tmp_path / f"w{case}"
        shutil.copytree(template, home)
        path = home / "kvchat.db"
        _damage_file(path, rng)
        before = {s: Path(f"{path}{s}").read_bytes() for s in ("", "-wal")}
        tally["cases"] += 1
        try:
            Store(path).close()
            tally["opened"] += 1  # damage in unused space: sound as far as SQLite can tell
        except DamagedDatabase:
            tally["refused"] += 1
            after = {s: Path(f"{path}{s}").read_bytes() for s in ("", "-wal")}
            assert after == before, case  # neither the file nor its WAL was touched
        except KvchatError as exc:  # an empty file kept aside, said on one line
            assert "empty" in str(exc) and "\n" not in str(exc), (case, exc)
        shutil.rmtree(home)
    return tally


def test_wal_on_a_damaged_file_campaign(tmp_path: Path):
    tally = _wal_cases(tmp_path, n=40, seed=4)
    assert tally["refused"] > 0


@pytest.mark.stress
def test_stress_wal_on_a_damaged_file(tmp_path: Path):
    tally = _wal_cases(tmp_path, n=STRESS_CASES, seed=14)
    print(f"\nSTRESS WAL on a damaged file: {tally}")


# --- forged bundles (the real model) ------------------------------------------------------------

GREEDY = dict(temperature=0.0, max_tokens=8, n_ctx=1024, chunk_tokens=16)
PROMPTS = [
    "Tell me about cats.",
    "Tell me about rain.",
    "Name a colour.",
    "What is two plus two?",
    "Tell me about the sea.",
]


def _bundle_of(service: Any, prompt: str, out: Path) -> Path:
    from kvchat.transfer import write_bundle

    report = service.start(prompt)
    write_bundle(service, report.session_id, out)
    return out


def _forge(rng: random.Random, genuine: Path, donors: list[Path], target: Path) -> Path:
    """``genuine`` with some KV members taken from other bundles (same positions) and the
    manifest's hashes recomputed."""
    with zipfile.ZipFile(genuine) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    manifest = json.loads(files.pop("manifest.json"))
    names = [entry["member"] for entry in manifest["kv"]["files"]]
    donor = rng.choice(donors)
    with zipfile.ZipFile(donor) as zf:
        theirs = set(zf.namelist())
        for name in rng.sample(names, rng.randint(1, len(names))):
            if name in theirs:
                data = zf.read(name)
                files[name] = data
                manifest["members"][name] = {
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                }
    with zipfile.ZipFile(target, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("manifest.json", json.dumps(manifest))
    return target


def _forged_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService

    rng = random.Random(seed)
    source = ChatService(Settings(**GREEDY), home=tmp_path / "source")  # owns the engine
    try:
        engine = source.engine
        bundles = [
            _bundle_of(source, prompt, tmp_path / f"b{i}.kvchat")
            for i, prompt in enumerate(PROMPTS)
        ]
        baseline_home = ChatService(Settings(**GREEDY), home=tmp_path / "baseline", engine=engine)
        try:
            baseline = {p: baseline_home.start(p, no_restore=True).reply for p in PROMPTS}
        finally:
            baseline_home.close()
        return _forged_runs(tmp_path, rng, n, engine, bundles, baseline)
    finally:
        source.close()


def _forged_runs(
    tmp_path: Path,
    rng: random.Random,
    n: int,
    engine: Any,
    bundles: list[Path],
    baseline: dict[str, str],
) -> dict[str, int]:
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService
    from kvchat.transfer import import_file

    tally = {"cases": 0, "kv_installed": 0, "kv_refused": 0}
    for case in range(n):
        home = tmp_path / f"h{case}"
        service = ChatService(Settings(**GREEDY), home=home, engine=engine)
        try:
            genuine = rng.randrange(len(bundles))
            others = [b for i, b in enumerate(bundles) if i != genuine]
            forged = _forge(rng, bundles[genuine], others, tmp_path / f"f{case}.kvchat")
            [item] = import_file(service, forged).sessions
            tally["cases"] += 1
            tally["kv_installed" if item.kv_tokens else "kv_refused"] += 1
            prompt = rng.choice(PROMPTS)
            report = service.start(prompt)
            assert report.restore.donor != item.session, case
            assert report.reply == baseline[prompt], (case, prompt)
        finally:
            service.close()
            shutil.rmtree(home)
    return tally


@pytest.mark.e2e
def test_forged_bundle_campaign(tmp_path: Path):
    tally = _forged_cases(tmp_path, n=4, seed=5)
    assert tally["cases"] == 4


@pytest.mark.e2e
@pytest.mark.stress
def test_stress_forged_bundles(tmp_path: Path):
    tally = _forged_cases(tmp_path, n=STRESS_CASES, seed=15)
    print(f"\nSTRESS forged bundles: {tally}")


# --- a full disk at every write of a turn (the real model) ---------------------------------------


def _full_disk_cases(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    """The k-th write of a turn finds the disk full, for every k the turn makes: what the
    report says of the reply matches what the database holds."""
    from kvchat.config import Settings
    from kvchat.service.chat import ChatService

    rng = random.Random(seed)
    owner = ChatService(Settings(**GREEDY), home=tmp_path / "owner")
    engine = owner.engine
    tally = {"cases": 0, "stored": 0, "cut": 0, "not_stored": 0, "refused": 0}
    real_tx = Store._tx
    # How many writes one turn makes (its reply saved at every token): case k fails the
    # (k mod that)+1-th, so every write of a turn is hit in turn.
    writes = {"n": 0}

    def counting(self: Store) -> Any:
        writes["n"] += 1
        return real_tx(self)

    calibration = ChatService(Settings(**GREEDY), home=tmp_path / "calibration", engine=engine)
    calibration.turns.stream_save_every_s = 0.0
    Store._tx = counting  # type: ignore[method-assign]
    try:
        calibration.send(calibration.sessions.new_session().id, PROMPTS[0])
    finally:
        Store._tx = real_tx  # type: ignore[method-assign]
        calibration.close()
    per_turn = writes["n"]
    try:
        for case in range(n):
            home = tmp_path / f"d{case}"
            service = ChatService(Settings(**GREEDY), home=home, engine=engine)
            service.turns.stream_save_every_s = 0.0
            session = service.sessions.new_session()
            fail_at = case % per_turn + 1
            count = {"n": 0}

            def tx(self: Store, fail_at: int = fail_at, count: dict[str, int] = count) -> Any:
                count["n"] += 1
                if count["n"] == fail_at:
                    raise StoreFull("the disk is full: could not write (database or disk is full)")
                return real_tx(self)

            Store._tx = tx  # type: ignore[method-assign]
            try:
                report = service.send(session.id, PROMPTS[0] if case % 2 else rng.choice(PROMPTS))
            except KvchatError:
                report = None
            finally:
                Store._tx = real_tx  # type: ignore[method-assign]
            tally["cases"] += 1
            rows = service.store._rows(
                "SELECT role, content, partial FROM messages WHERE session_id=? ORDER BY id",
                (session.id,),
            )
            replies = [r for r in rows if r["role"] == "assistant"]
            if report is None:
                tally["refused"] += 1  # the message itself was not stored, or no reply
                assert not replies or replies[-1]["partial"] == 1, case
            elif report.reply_error is None:
                tally["stored"] += 1
                assert replies and replies[-1]["content"] == report.reply, case
            elif report.stored_part is not None:
                tally["cut"] += 1
                assert replies[-1]["partial"] == 1, case
                assert len(replies[-1]["content"]) == report.stored_part, case
                assert report.reply.startswith(replies[-1]["content"]), case
            else:
                tally["not_stored"] += 1
                assert not replies, case
            service.close()
            shutil.rmtree(home)
    finally:
        Store._tx = real_tx  # type: ignore[method-assign]
        owner.close()
    return tally


@pytest.mark.e2e
def test_full_disk_at_every_write_campaign(tmp_path: Path):
    tally = _full_disk_cases(tmp_path, n=12, seed=6)
    assert tally["cases"] == 12


@pytest.mark.e2e
@pytest.mark.stress
def test_stress_full_disk_at_every_write(tmp_path: Path):
    tally = _full_disk_cases(tmp_path, n=STRESS_CASES, seed=16)
    print(f"\nSTRESS full disk at every write: {tally}")
