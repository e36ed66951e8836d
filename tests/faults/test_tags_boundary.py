"""Tags are a door (issue 41, item 7): whatever a user types as a session's tags (Ctrl+G)
or as ``kvchat list --tag`` (escapes, control characters, lone surrogates, SQL and LIKE
wildcards, quotes, commas, ``#`` runs, megabyte strings), kvchat keeps a bounded tuple of
lowercase words that the list's pages find again exactly, or says in one line why not;
never a traceback, never another session's tags touched, never a raw escape printed. A tags
column kvchat did not write reads as no tags. Seeded cases in-process (no model); a
20-case sample runs by default, ``pytest -m stress`` runs 240.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvchat.cli import main
from kvchat.errors import KvchatError
from kvchat.paths import data_dir
from kvchat.store import Store
from kvchat.store.tags import MAX_TAG_CHARS, MAX_TAGS, parse_tags

_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_PIECES = [
    "work",
    "Rust",
    "#",
    "##",
    ",",
    " ",
    "\t",
    "\r\n",
    "\x1b[2J",
    "\x1b]0;title\x07",
    "\x9b31m",
    "%",
    "_",
    "\\",
    "'",
    '"',
    "; DROP TABLE sessions; --",
    "\udcff",
    "\x00",
    "é",
    "\u202e",
    "日本",
    "-",
    "ß",
    "İ",
]


def hostile(rng: random.Random) -> str:
    """Tags a user might type, or hostile text."""
    roll = rng.random()
    if roll < 0.1:
        return "x" * rng.randint(MAX_TAG_CHARS - 2, 1_000_000)
    if roll < 0.2:
        return " ".join(f"#t{i}" for i in range(rng.randint(1, MAX_TAGS + 4)))
    if roll < 0.5:  # what a user types: words, #, commas and spaces (some words repeated)
        words = ["work", "Rust", "a_b", "x-y", "é", "日本", "ß", "İ", "2026", "_"]
        seps = [" ", ", ", " #", ",#", "  "]
        return "".join(rng.choice(seps) + rng.choice(words) for _ in range(rng.randint(1, 7)))
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 14)))


def one_line_out(text: str) -> None:
    assert text.count("\n") <= 1 and not _UNSAFE.search(text.rstrip("\n")), repr(text[:200])


def campaign(home: Path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"kept": 0, "refused": 0}
    store = Store(data_dir() / "kvchat.db")
    runner = CliRunner()
    try:
        target = store.create_session("Target")
        other = store.create_session("Other")
        store.set_tags(other.id, ("keep", "me"))
        for _ in range(cases):
            text = hostile(rng)
            try:
                tags = parse_tags(text)
            except KvchatError as exc:
                one_line_out(str(exc))
                assert len(str(exc)) < 300, len(str(exc))
                counts["refused"] += 1
                result = runner.invoke(main, ["list", "--tag", text[:100_000]])
                assert result.exit_code == 2, (text[:80], result.output[:200])
                one_line_out(result.stderr)
                continue
            counts["kept"] += 1
            assert len(tags) <= MAX_TAGS
            for tag in tags:
                assert 0 < len(tag) <= MAX_TAG_CHARS and tag == tag.casefold()
                assert not re.search(r"[\s,#%\\'\"]", tag) and not _UNSAFE.search(tag)
            assert parse_tags(" ".join(tags)) == tags  # what is stored parses back the same
            store.set_tags(target.id, tags)
            assert store.get_session(target.id).tags == tags
            assert store.get_session(other.id).tags == ("keep", "me")
            for tag in tags:
                found = {s.session.id for s in store.list_sessions_page(10, tag=tag).sessions}
                assert found == {target.id}, (tag, found)
            if tags:
                result = runner.invoke(main, ["list", "--json", "--tag", tags[0]])
                assert result.exit_code == 0, result.output[:200]
                assert f'"id": "{target.id}"' in result.stdout
                assert f'"id": "{other.id}"' not in result.stdout
        # A column written by something else reads as no tags, and lists clean.
        store.conn.execute(
            "UPDATE sessions SET tags=? WHERE id=?", (hostile(rng) + "\x1b[2J", target.id)
        )
        store.conn.commit()
        assert store.get_session(target.id).tags in ((), parse_tags_or_none(store, target.id))
        listed = runner.invoke(main, ["list", "--all"])
        assert listed.exit_code == 0
        for line in listed.stdout.splitlines():
            assert not _UNSAFE.search(line), repr(line)
    finally:
        store.close()
    return counts


def parse_tags_or_none(store: Store, session_id: str) -> tuple[str, ...]:
    raw = store.conn.execute("SELECT tags FROM sessions WHERE id=?", (session_id,)).fetchone()[0]
    try:
        return parse_tags(raw)
    except KvchatError:
        return ()


def test_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    counts = campaign(tmp_path / "home", 20, seed=7)
    assert sum(counts.values()) == 20


@pytest.mark.stress
def test_stress_campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    counts = campaign(tmp_path / "home", 240, seed=2026)
    print(
        f"\nSTRESS tags: 240 hostile tag texts, {counts['kept']} kept, {counts['refused']} refused"
    )
    assert counts["kept"] > 0 and counts["refused"] > 0
