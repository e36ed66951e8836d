"""Every `kvchat` command on a database whose index is damaged says to run doctor, in one
line, and writes nothing. Real SQLite files, damaged byte by byte."""

from __future__ import annotations

from tests.unit.store.test_database_damage import _files, _home, damage_index


def test_every_command_on_a_damaged_index_says_doctor_and_writes_nothing(tmp_path, cli):
    home = tmp_path / "home"
    home.mkdir()
    path = home / "kvchat.db"
    session_id, _ = _home(path)
    damage_index(path, "idx_messages_session_id_id", session_id)
    before = _files(path)
    for args in (
        ["ask", "--session", session_id, "Hello?"],
        ["list"],
        ["export", session_id],
        ["fork", session_id],
    ):
        result = cli(home, *args, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args, result.stderr)
        assert "damaged" in lines[0] and "kvchat doctor" in lines[0]
    assert _files(path) == before
