"""``kvchat list --pinned / --tag`` and its JSON's pinned and tags (issue 41, item 7); the
list's TOKENS are the app's figure; ``kvchat export -o FILE`` writes 0600 like the app's
exports (item 9). In this process (CliRunner), on a real database, no model."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from click.testing import CliRunner

from kvchat.cli import main
from kvchat.paths import data_dir
from kvchat.store import Store


def _seed() -> dict[str, str]:
    store = Store(data_dir() / "kvchat.db")
    try:
        ids = {}
        for title in ("Rust notes", "Groceries", "Taxes"):
            session = store.create_session(title)
            store.add_message(session.id, "user", f"about {title}", token_count=5)
            ids[title] = session.id
        store.set_pinned(ids["Groceries"], True)
        store.set_tags(ids["Rust notes"], ("work", "rust"))
        store.set_tags(ids["Taxes"], ("home",))
        return ids
    finally:
        store.close()


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_list_filters_pinned_and_tagged_and_its_json_carries_them(kvhome: Path) -> None:
    ids = _seed()
    every = json.loads(_invoke("list", "--json").stdout)
    assert {i["id"]: (i["pinned"], i["tags"]) for i in every} == {
        ids["Rust notes"]: (False, ["work", "rust"]),
        ids["Groceries"]: (True, []),
        ids["Taxes"]: (False, ["home"]),
    }
    assert all(i["tokens"] == i["message_tokens"] == 5 for i in every)  # no snapshot
    pinned = json.loads(_invoke("list", "--json", "--pinned").stdout)
    assert [i["id"] for i in pinned] == [ids["Groceries"]]
    for tag in ("work", "#work", "WORK"):
        tagged = json.loads(_invoke("list", "--json", "--tag", tag).stdout)
        assert [i["id"] for i in tagged] == [ids["Rust notes"]], tag
    assert json.loads(_invoke("list", "--json", "--tag", "wor").stdout) == []  # whole tags
    text = _invoke("list", "--all").stdout
    assert "★ Groceries" in text and "#work #rust" in text and "#home" in text
    none = _invoke("list", "--pinned", "--tag", "home")
    assert none.exit_code == 0
    assert (
        none.stdout
        == "No sessions pinned and tagged #home (the app's Ctrl+G sets tags, Shift+F3 pins)\n"
    )


def test_a_bad_tag_is_one_line(kvhome: Path) -> None:
    _seed()
    for bad in ("a/b", "two tags", "\x1b[2J"):
        result = CliRunner().invoke(main, ["list", "--tag", bad])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "\x1b" not in result.output, result.output


def test_export_to_a_file_is_readable_by_its_owner_only(kvhome: Path, tmp_path: Path) -> None:
    ids = _seed()
    out = tmp_path / "out" / "notes.md"
    out.parent.mkdir()
    result = _invoke("export", ids["Rust notes"], "-o", str(out))
    assert result.exit_code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "about Rust notes" in out.read_text(encoding="utf-8")
    link = tmp_path / "out" / "link.md"
    link.symlink_to(tmp_path / "elsewhere.md")
    refused = CliRunner().invoke(main, ["export", ids["Taxes"], "-o", str(link)])
    assert refused.exit_code == 2 and not (tmp_path / "elsewhere.md").exists()
