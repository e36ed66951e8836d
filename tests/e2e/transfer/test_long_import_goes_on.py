"""An imported conversation far longer than the context goes on: the next turn fits the
window and replies. The real model."""

from __future__ import annotations

from tests.conftest import FAST


def test_an_imported_conversation_far_longer_than_the_context_goes_on(kvhome, tmp_path, cli):
    """A ChatGPT conversation of 1,200 messages (~16,000 tokens) imported, then continued
    with n_ctx 1024: the reply comes from the newest messages that fit (the window rendered
    the whole history once per message left out: minutes here, hours at 5,000 messages)."""
    from kvchat.bench.export_gen import LONG_TITLE, write_long_export

    export = tmp_path / "conversations.json"
    write_long_export(export, 1200, sizes=(4, 8))
    cli(kvhome, "import", str(export))
    listed = cli(kvhome, "list", "--json").json
    assert [s["messages"] for s in listed] == [1200] and listed[0]["title"].startswith(LONG_TITLE)
    report = cli(kvhome, "ask", "--session", listed[0]["id"], "And then?", "--json", *FAST).json
    window = report["window"]
    assert report["reply"].strip() and report["message_id"] is not None
    assert 1100 < window["dropped_messages"] < 1201
    assert report["tokens"]["prompt"] <= 1024 - 24
    assert report["tokens"]["decoded"] == report["tokens"]["prompt"]  # nothing to reuse
    assert cli(kvhome, "list", "--json").json[0]["messages"] == 1202
