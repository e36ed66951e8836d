"""Model-free pieces of the families' resumes: built-in chat templates and the fallback,
template files and bad names, the template setting, snapshot rows that keep their
checkpoints and refuse damaged ones, layout descriptions with a window part, a state that
cannot be chunked stored whole with the reason, and window pieces on the chunk grid."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.engine import EngineCapabilities
from kvchat.errors import KvchatError
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.planner.templates import BUILTIN, CHATML, choose_template, load_template
from kvchat.store import SnapshotRow
from tests.stand_in_engine import EngineDefaults

# ------------------------------------------------------------------- chat templates


def test_builtin_templates_and_the_fallback() -> None:
    assert {"chatml", "gemma", "llama3", "mistral", "phi3"} <= set(BUILTIN)
    own = choose_template(None, "{{ messages }}")
    assert (own.source, own.note) == ("gguf", None)
    guess = choose_template(None, None)
    assert guess.text == CHATML and guess.source == "fallback"
    assert "no chat template" in guess.note and "--chat-template" in guess.note
    catalog = choose_template(None, "", "gemma")
    assert catalog.text == BUILTIN["gemma"] and "catalog" in catalog.note
    chosen = choose_template("Gemma", None)
    assert chosen.text == BUILTIN["gemma"] and "your chat_template setting" in chosen.note
    assert "not the model's own" in choose_template("llama3", "{{ x }}").note


def test_template_files_and_bad_names(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert load_template(str(path)) == (path.read_text(encoding="utf-8"), str(path))
    with pytest.raises(KvchatError, match="built-in name"):
        load_template("no-such-template")
    (tmp_path / "empty.jinja").write_text(" ", encoding="utf-8")
    with pytest.raises(KvchatError, match="empty"):
        load_template(str(tmp_path / "empty.jinja"))


def test_chat_template_setting_from_env(monkeypatch: pytest.MonkeyPatch, kvhome: Path) -> None:
    monkeypatch.setenv("KVCHAT_CHAT_TEMPLATE", "phi3")
    settings = load_settings()
    assert settings.chat_template == "phi3"
    assert settings.sources()["chat_template"] == "env KVCHAT_CHAT_TEMPLATE"
    assert load_settings(chat_template="gemma").sources()["chat_template"] == "flag"


def test_snapshot_rows_keep_their_checkpoints_and_refuse_damaged_ones() -> None:
    row = SnapshotRow("abcd1234", "", 3, [1, 2, 3], {}, 0, "", format="chunks")
    row.checkpoints = [[0, 2, "ab" * 16]]
    assert SnapshotRow.from_row(row.to_row()).checkpoints == [[0, 2, "ab" * 16]]
    damaged = row.to_row() | {"checkpoints": '[[2, 1, "ab"]]'}
    assert "checkpoints" in (SnapshotRow.from_row(damaged).damage or "")


def test_layout_descriptions_with_a_window_part_are_checked() -> None:
    base = {"magic": 1, "cell_meta_size": 12, "v_trans": 1, "n_layer": 1}
    base |= {"k": [[1, 32]], "v": [[1, 2, 16]]}
    kvlayout.check_desc(base)
    window = {key: value for key, value in base.items() if key != "magic"} | {"n_swa": 32}
    kvlayout.check_desc(base | {"swa": window})
    spec = kvlayout.swa_spec(base | {"swa": window})
    assert spec is not None and spec.k_widths == (16,) and spec.v_widths == (16,)
    for bad in ({**window, "n_swa": 0}, {**window, "k": [[99, 32]]}, "x"):
        with pytest.raises(kvlayout.LayoutError):
            kvlayout.check_desc(base | {"swa": bad})


class RecurrentEngine(EngineDefaults):
    """Just enough of an engine whose state is not per-token KV (a recurrent model)."""

    n_ctx = 1024
    tokens = [5, 6, 7]
    capabilities = EngineCapabilities(seq_state=True)

    def state_get(self) -> memoryview:
        return memoryview(bytes(64))

    def kv_shape(self) -> tuple[int, int, int]:
        return (1, 16, 16)

    def chunk_problem(self) -> str | None:
        return "a recurrent model keeps a fixed-size state, not per-token KV"


def test_a_state_that_cannot_be_chunked_is_stored_whole_with_the_reason(tmp_path: Path) -> None:
    from kvchat.kvcache import Fingerprint, SnapshotStore
    from kvchat.store import Store

    store = Store(tmp_path / "kv.db")
    session = store.create_session("t").id
    snapshots = SnapshotStore(tmp_path / "snapshots", store)
    fingerprint = Fingerprint("m", "m.gguf", "0", "f16", "f16", False, 1e4, 1.0, 0, 1)
    saved = snapshots.save(session, RecurrentEngine(), fingerprint)  # type: ignore[arg-type]
    assert saved.row.format == "blob" and "recurrent" in (saved.whole_reason or "")
    unknown = RecurrentEngine()
    unknown.chunk_problem = lambda: None  # type: ignore[method-assign]
    saved = snapshots.save(session, unknown, fingerprint)  # type: ignore[arg-type]
    assert saved.row.format == "blob" and "not a layout" in (saved.whole_reason or "")
    off = SnapshotStore(tmp_path / "snapshots", store, chunked=False)
    assert off.save(session, unknown, fingerprint).whole_reason is None  # the user's choice


def test_window_pieces_cover_a_window_on_the_grid() -> None:
    from kvchat.kvcache.cold.checkpoints import PIECE_TOKENS, Piece, cover, grid

    assert PIECE_TOKENS == 64
    assert grid(16, 48) == [(16, 48)]
    assert grid(100, 300) == [(100, 128), (128, 192), (192, 256), (256, 300)]
    pieces = [Piece(0, 64, "a"), Piece(64, 128, "b"), Piece(64, 100, "c"), Piece(128, 150, "d")]
    assert cover(pieces, 10, 140) == [pieces[0], pieces[1], pieces[3]]
    assert cover(pieces, 70, 90) == [pieces[1]]
    assert cover(pieces, 100, 160) is None
