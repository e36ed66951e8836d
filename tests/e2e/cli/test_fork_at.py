"""`kvchat fork --at N` takes the message number the app and the exports show, and the
forks' titles are numbered; `kvchat` commands run in the test's process."""

from __future__ import annotations

from tests.conftest import run_cli_here

# --- item 6: fork --at N (the message's number) and numbered fork titles ----------------------


def test_fork_at_takes_the_message_number_and_numbers_titles(one_turn_home, copy_home) -> None:
    source, turn = one_turn_home
    home = copy_home(source, "fork-home")
    session = turn["session"]
    first = run_cli_here(home, "fork", session, "--at", "1", "--json").json
    assert first["messages"] == 1
    exported = run_cli_here(home, "export", first["session"], "--format", "json").json
    assert [m["role"] for m in exported["messages"]] == ["user"]
    parent_title = run_cli_here(home, "export", session, "--format", "json").json["session"][
        "title"
    ]
    # Named by what it is and where it starts, first (issue 22.8).
    assert first["title"] == f"Fork at #1: {parent_title}"
    second = run_cli_here(home, "fork", session, "--json").json
    assert second["title"] == f"Fork at #2: {parent_title}" and second["messages"] == 2
    again = run_cli_here(home, "fork", session, "--json").json
    assert again["title"] == f"Fork at #2 (2): {parent_title}"
    # A fork of a fork names the original title once.
    third = run_cli_here(home, "fork", first["session"], "--json").json
    assert third["title"] == f"Fork at #1 (2): {parent_title}"
    # Numbers out of range are one line, exit 2; nothing is made.
    for bad in ("0", "3"):
        result = run_cli_here(home, "fork", session, "--at", bad, check=False)
        assert result.returncode == 2 and "no message #" in result.stderr, result.stderr
    assert len(run_cli_here(home, "list", "--json").json) == 5
    assert "--at N" in run_cli_here(home, "fork", "--help").stdout
