"""The fault suite: kills, damaged snapshots and index rows, a full disk, racing processes,
a damaged database. Every case ends with the database intact, no traceback, no lost
message, and either a resume whose greedy reply equals a full prefill or a fallback with a
reason.

The default run is sized for CI (a few minutes); ``pytest -m stress`` runs the same cases
by the thousand (``KVCHAT_STRESS_CASES`` / ``KVCHAT_STRESS_KILLS`` set how many).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import Settings
from kvchat.service.chat import ChatService
from tests.conftest import FAST, REPO, CliResult, clean_env, run_cli, run_cli_here

DEFAULT_CASES = 7
GREEDY = dict(temperature=0.0, max_tokens=8, n_ctx=1024)
GREEDY_FLAGS = [*FAST, "--max-tokens", "8"]  # the same, for the CLI (the last flag wins)


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_env()
    env["KVCHAT_HOME"] = str(home)
    env.update(extra or {})
    return env


def _popen(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvchat", *args],
        cwd=REPO,
        env=_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_clean(result: CliResult | subprocess.CompletedProcess[str]) -> None:
    """Exit 0, or exit 2 with one line on stderr: never a traceback."""
    stderr = result.stderr
    assert "Traceback" not in stderr, stderr
    assert result.returncode in (0, 2), (result.returncode, stderr)
    if result.returncode == 2:
        lines = [line for line in stderr.strip().splitlines() if not line.startswith("plan:")]
        assert len(lines) == 1 and lines[0].startswith("kvchat: "), stderr


def db_state(home: Path) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(session, role, content) of every message, and the session ids, after an integrity check."""
    db = sqlite3.connect(home / "kvchat.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        messages = db.execute(
            "SELECT session_id, role, content FROM messages ORDER BY id"
        ).fetchall()
        sessions = [s for (s,) in db.execute("SELECT id FROM sessions")]
    finally:
        db.close()
    return messages, sessions


def assert_files_consistent(home: Path) -> None:
    """Every index row has its file (no row points at a torn write)."""
    db = sqlite3.connect(home / "kvchat.db")
    try:
        blobs = [p for (p,) in db.execute("SELECT path FROM kv_snapshots WHERE format='blob'")]
        chunks = [p for (p,) in db.execute("SELECT path FROM kv_chunks")]
    finally:
        db.close()
    for path in blobs:
        assert (home / "snapshots" / path).is_file(), path
    for path in chunks:
        assert (home / "snapshots" / "chunks" / path).is_file(), path


# --- kills -----------------------------------------------------------------------------------


@dataclass
class KillOutcome:
    kind: str
    delay: float
    exited: int | None


def _kill_after(proc: subprocess.Popen[str], delay: float) -> int | None:
    """SIGKILL ``proc`` after ``delay`` seconds unless it ended; its exit code if it did."""
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        return None
    out, err = proc.communicate()
    assert "Traceback" not in err, err
    return proc.returncode


def _kill_campaign(
    tmp_path: Path, n_turns: int, n_forks: int, n_gcs: int, seed: int
) -> list[KillOutcome]:
    rng = random.Random(seed)
    home = tmp_path / "killed"
    first = run_cli(home, "ask", "--new", "Hi", "--json", *FAST).json
    session = first["session"]
    # Kill points spread over one whole turn's time on this machine, however fast it is:
    # a second turn's (the first start in a home may also probe the engine).
    started = time.monotonic()
    run_cli(home, "ask", "--session", session, "Ready?", *FAST)
    turn_s = time.monotonic() - started
    # A long session for forks: a fork copies every message.
    service = ChatService(Settings(), home=home)
    big = service.sessions.new_session(title="big")
    for i in range(1500):
        service.sessions.add_message(big.id, "user" if i % 2 == 0 else "assistant", f"message {i}")
    service.close()
    sent: list[str] = ["Ready?"]
    outcomes: list[KillOutcome] = []
    kinds = ["turn"] * n_turns + ["fork"] * n_forks + ["gc"] * n_gcs
    rng.shuffle(kinds)
    for i, kind in enumerate(kinds):
        delay = rng.uniform(0.05, 0.95) * turn_s
        if kind == "turn":
            text = f"Question number {i}?"
            sent.append(text)
            proc = _popen(home, "ask", "--session", session, text, *FAST)
        elif kind == "fork":
            proc = _popen(home, "fork", big.id)
        else:
            proc = _popen(home, "cache", "gc")
        outcomes.append(KillOutcome(kind, delay, _kill_after(proc, delay)))

        messages, sessions = db_state(home)
        assert_files_consistent(home)
        # No lost message: what was committed stays, in order, never duplicated.
        users = [c for (s, r, c) in messages if s == session and r == "user"]
        assert users[0] == "Hi" and len(set(users)) == len(users)
        assert all(u in sent for u in users[1:])
        assert [u for u in sent if u in users] == users[1:]
        # A fork is whole or absent.
        for sid in sessions:
            if sid not in (session, big.id):
                n = sum(1 for (s, _, _) in messages if s == sid)
                assert n == 1500, f"half-made fork {sid}: {n} of 1500 messages"

    # The session still resumes: equal to a full prefill of the same history.
    twin = tmp_path / "twin"
    shutil.copytree(home, twin)
    resumed = run_cli(home, "ask", "--session", session, "And finally?", "--json", *FAST)
    assert_clean(resumed)
    baseline = run_cli(
        twin, "ask", "--session", session, "And finally?", "--json", "--no-restore", *FAST
    )
    assert resumed.json["reply"] == baseline.json["reply"]
    # And the turn after it (killed by nobody) resumes from the snapshot that one wrote.
    after = run_cli(home, "ask", "--session", session, "One more?", "--json", *FAST).json
    assert after["restore"]["from"] == "disk", after["restore"]
    assert after["tokens"]["decoded"] < 32, after["tokens"]
    return outcomes


def test_kills_during_turns_forks_and_gc(tmp_path: Path):
    # A sample (tests/stress/test_kill_and_damage_campaigns.py kills by the hundred).
    outcomes = _kill_campaign(tmp_path, n_turns=5, n_forks=2, n_gcs=2, seed=9)
    assert len(outcomes) == 9
    # Kill points scale with a measured turn; under heavy load more runs end first.
    assert sum(o.exited is None for o in outcomes) >= len(outcomes) // 4


# --- damaged snapshots and index rows --------------------------------------------------------


def _flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return "empty file"
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"bit flip at {at} of {path.name}"


def _truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    keep = rng.randrange(size) if size else 0
    with open(path, "r+b") as fh:
        fh.truncate(keep)
    return f"truncate {path.name} to {keep}"


def _snapshot_files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "snapshots").rglob("*") if p.is_file())


COLUMNS = {
    "kv_snapshots": [
        "path",
        "n_tokens",
        "token_ids",
        "fingerprint",
        "n_bytes",
        "checksum",
        "format",
        "chunk_keys",
        "layout",
    ],
    "kv_chunks": ["key", "path", "start", "n_tokens", "n_bytes", "checksum"],
}
ODD_VALUES: list[Any] = [
    None,
    -1,
    0,
    3,
    2**40,
    "",
    "../x",
    "/etc/passwd",
    "{}",
    "[]",
    "[1]",
    '{"k": 1}',
    b"\x01\x02\x03",
    b"",
    "garbage",
    1.5,
    "chunks",
    "blob",
]


def _edit_row(home: Path, rng: random.Random) -> str:
    db = sqlite3.connect(home / "kvchat.db")
    try:
        table = rng.choice(list(COLUMNS))
        rows = db.execute(f"SELECT rowid FROM {table}").fetchall()
        if not rows:
            return "no rows"
        (rowid,) = rng.choice(rows)
        column = rng.choice(COLUMNS[table])
        if rng.random() < 0.5:  # another row's value: a swap between sessions or chunks
            others = db.execute(
                f"SELECT {column} FROM {table} WHERE rowid != ?", (rowid,)
            ).fetchall()
            value = rng.choice(others)[0] if others else rng.choice(ODD_VALUES)
        else:
            value = rng.choice(ODD_VALUES)
        try:
            with db:
                db.execute(f"UPDATE {table} SET {column}=? WHERE rowid=?", (value, rowid))
        except sqlite3.IntegrityError:
            return "edit refused by a constraint"
        return f"{table}.{column} of row {rowid} := {value!r:.40}"
    finally:
        db.close()


def _swap_files(files: list[Path], rng: random.Random) -> str:
    """Swap the contents of two of ``files`` (at least two) by renaming them."""
    a, b = rng.sample(files, 2)
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return f"swap {a.name} and {b.name}"


DAMAGE_KINDS = ["flip", "flip", "truncate", "row", "row", "swap", "delete"]
FIRST_KINDS = sorted(set(DAMAGE_KINDS))


def _damage(home: Path, rng: random.Random, kinds: set[str], kind: str | None = None) -> str:
    """One damage to ``home``'s snapshots or their rows, of ``kind`` or a random one (its
    kind added to ``kinds`` once done): what was done, in words."""
    kind = kind or rng.choice(DAMAGE_KINDS)
    files = _snapshot_files(home)
    if kind == "row" or not files:
        kind, what = "row", _edit_row(home, rng)
    elif kind == "swap" and len(files) < 2:
        kind, what = "none", "too few files to swap"
    elif kind == "swap":
        what = _swap_files(files, rng)
    else:
        target = rng.choice(files)
        if kind == "flip":
            what = _flip(target, rng)
        elif kind == "truncate":
            what = _truncate(target, rng)
        else:
            target.unlink()
            what = f"delete {target.name}"
    kinds.add(kind)
    return what


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[str, str]]:
    """A home with two sessions with snapshots, and each one's greedy next reply after a
    full prefill (the answer every damaged case must give)."""
    home = tmp_path_factory.mktemp("pristine") / "home"
    a = run_cli(home, "ask", "--new", "Tell me about rain.", "--json", *FAST).json["session"]
    run_cli(home, "ask", "--session", a, "And snow?", "--json", *FAST)
    b = run_cli(home, "ask", "--new", "Tell me about cats.", "--json", *FAST).json["session"]
    expected: dict[str, str] = {}
    for session in (a, b):
        twin = tmp_path_factory.mktemp("baseline") / "home"
        shutil.copytree(home, twin)
        baseline = run_cli(
            twin, "ask", "--session", session, "Why?", "--json", "--no-restore", *GREEDY_FLAGS
        )
        expected[session] = baseline.json["reply"]
    return home, [a, b], expected


def _damage_cases(pristine, tmp_path: Path, n: int, seed: int) -> dict[str, Any]:
    home, sessions, expected = pristine
    rng = random.Random(seed)
    tally: dict[str, Any] = {"cases": 0, "resumed": 0, "fallbacks": 0, "kinds": set()}
    # One loaded model for every case: each case is its own home and its own service.
    owner = ChatService(Settings(**GREEDY), home=tmp_path / "engine-owner")
    engine = owner.engine
    try:
        for case in range(n):
            _damage_case(home, sessions, expected, tmp_path, case, rng, engine, tally)
    finally:
        owner.close()
    return tally


def _damage_case(
    home: Path,
    sessions: list[str],
    expected: dict[str, str],
    tmp_path: Path,
    case: int,
    rng: random.Random,
    engine: Any,
    tally: dict[str, Any],
) -> None:
    """Copy the pristine home, damage it, and run one greedy turn on it."""
    target = tmp_path / f"case{case % 4}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(home, target)
    # The first cases take each kind in turn (every kind is tried at any count), then random.
    first = FIRST_KINDS[case] if case < len(FIRST_KINDS) else None
    damages = [_damage(target, rng, tally["kinds"], first)]
    damages += [_damage(target, rng, tally["kinds"]) for _ in range(rng.choice([0, 0, 1]))]
    what = "; ".join(damages)
    session = rng.choice(sessions)
    service = ChatService(Settings(**GREEDY), home=target, engine=engine)
    try:
        report = service.send(session, "Why?")
        service.cache_gc()
    finally:
        service.close()
    assert report.reply == expected[session], f"case {case} ({what}): wrong reply"
    if report.restore.source == "disk":
        tally["resumed"] += 1
    else:
        assert report.restore.reason, f"case {case} ({what}): a fallback without a reason"
        tally["fallbacks"] += 1
    db_state(target)
    tally["cases"] += 1


def test_damaged_snapshots_and_rows_resume_exactly_or_fall_back(pristine, tmp_path: Path):
    # 7 cases (each a greedy turn, ~0.5 s) try every kind of damage and both outcomes;
    # `pytest -m stress` runs STRESS_CASES of them.
    tally = _damage_cases(pristine, tmp_path, n=DEFAULT_CASES, seed=1)
    assert tally["cases"] == DEFAULT_CASES and tally["resumed"] and tally["fallbacks"]
    assert set(DAMAGE_KINDS) <= tally["kinds"], tally["kinds"]


# --- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Callable[[int], Path]:
    """A directory on a small tmpfs (mounting needs root; CI runs as root)."""
    mounted: list[Path] = []

    def make(mib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs for the full-disk test: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _free(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def _fill(directory: Path, leave: int) -> None:
    """Fill the filesystem of ``directory`` until ``leave`` bytes are free (at most a few
    blocks more), and check that it did."""
    with open(directory / "filler", "wb") as fh:
        try:
            fh.write(b"\0" * max(0, _free(directory) - leave))
            fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc  # full a little early: what was asked
    assert _free(directory) <= leave + 64 * 1024, f"the disk did not fill: {_free(directory)}"


def test_a_full_disk_gives_one_clear_line_and_keeps_the_reply(small_disk, tmp_path: Path):
    disk = small_disk(64)
    home = disk / "home"
    first = run_cli_here(home, "ask", "--new", "Hi", "--json", *FAST).json
    session = first["session"]
    _fill(disk, leave=256 * 1024)  # room for the database's messages, not for KV
    said_full, kept = [], []
    for i in range(6):
        result = run_cli_here(
            home, "ask", "--session", session, f"Next {i}?", "--json", *FAST, check=False
        )
        assert_clean(result)
        if result.returncode == 0:
            reply = json.loads(result.stdout)
            assert reply["reply"] and reply["message_id"], "a reply was generated but not kept"
            kept.append(reply["reply"])
            if reply["snapshot"]["error"]:
                assert "disk is full" in reply["snapshot"]["error"], reply["snapshot"]["error"]
                said_full.append(i)
        else:
            assert "disk is full" in result.stderr, result.stderr
            said_full.append(i)
    # The KV of a turn (~2 MB) cannot fit in 256 KiB: the turns said so, and kept replies.
    assert said_full, "no turn reported the full disk"
    assert kept, "no reply was kept on the nearly full disk"
    messages, _ = db_state(home)
    assert set(kept) <= {c for (_, r, c) in messages if r == "assistant"}
    assert_files_consistent(home)
    # Completely full: every command still answers in one line.
    _fill(disk, leave=0)
    for args in (
        ["list"],
        ["cache"],
        ["ask", "--session", session, "Still there?", *FAST],
        ["export", session],
    ):
        assert_clean(run_cli_here(home, *args, check=False))
    (disk / "filler").unlink()
    messages, _ = db_state(home)
    assert [c for (_, r, c) in messages if r == "user"][:2] == ["Hi", "Next 0?"]
    resumed = run_cli_here(home, "ask", "--session", session, "And now?", "--json", *FAST)
    assert_clean(resumed)


# --- two processes -----------------------------------------------------------------------------


def test_two_processes_on_one_session_never_answer_together(one_turn_home, copy_home):
    home = copy_home(one_turn_home[0], "race")
    session = one_turn_home[1]["session"]
    procs = [
        _popen(
            home,
            "ask",
            "--session",
            session,
            f"Racer {i}: say hi.",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "48",
            "--n-ctx",
            "1024",
        )
        for i in range(2)
    ]
    results = [subprocess.CompletedProcess(p.args, p.wait(300), *p.communicate()) for p in procs]
    for result in results:
        assert_clean(result)
    busy = [r for r in results if r.returncode == 2]
    for r in busy:
        assert "busy" in r.stderr and "process" in r.stderr
    messages, _ = db_state(home)
    roles = [r for (s, r, _) in messages if s == session]
    # Turns never interleave: user, assistant, user, assistant, ...
    assert roles == ["user", "assistant"] * (len(roles) // 2), roles
    assert len(roles) == 2 + 2 * (2 - len(busy))


# --- a damaged database ------------------------------------------------------------------------


def test_a_damaged_database_is_refused_then_salvaged_by_doctor(one_turn_home, copy_home, cli):
    home = copy_home(one_turn_home[0], "damaged")
    session = one_turn_home[1]["session"]
    # Enough text that damage in the middle of the file spares the session's row.
    service = ChatService(Settings(), home=home)
    for i in range(300):
        service.sessions.add_message(
            session, "user" if i % 2 == 0 else "assistant", f"padding {i} " + "y" * 300
        )
    service.close()
    db = sqlite3.connect(home / "kvchat.db")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    path = home / "kvchat.db"
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        fh.write(os.urandom(8192))
    damaged = path.read_bytes()
    for args in (["ask", "--session", session, "Hello?"], ["list"], ["export", session]):
        result = cli(home, *args, check=False)
        assert result.returncode == 2 and "kvchat doctor" in result.stderr, result.stderr
        assert_clean(result)
    assert path.read_bytes() == damaged  # never written to
    doctor = cli(home, "doctor", check=False)
    assert_clean(doctor)
    assert "damaged" in doctor.stdout + doctor.stderr
    fixed = cli(home, "doctor", "--salvage")
    assert "salvaged" in fixed.stdout
    aside = [
        p
        for p in home.iterdir()
        if p.name.startswith("kvchat.db.damaged-") and "-wal" not in p.name and "-shm" not in p.name
    ]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged
    listed = cli(home, "list", "--json").json
    assert [s["id"] for s in listed] == [session]
    resumed = cli(home, "ask", "--session", session, "Hello again?", "--json", *FAST).json
    assert resumed["reply"]
    # Salvage keeps the text, not the KV index: one full prefill, then resumes as before.
    assert resumed["restore"]["from"] == "none"
    assert resumed["restore"]["reason"] == "no snapshot saved for this session yet"
    again = cli(home, "ask", "--session", session, "Still here?", "--json", *FAST).json
    assert again["restore"]["from"] == "disk" and again["tokens"]["decoded"] < 32
