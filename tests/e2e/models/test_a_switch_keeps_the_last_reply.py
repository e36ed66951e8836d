"""A model switch right after a reply keeps the reply in the session's KV (issue 41, item 4:
"one F9 → Down → Enter … the next message re-read 370 tokens"). The app defers a turn's
settle and snapshot write to idle time; a switch before they ran dropped them, so the KV
saved at the switch ended before the reply and coming back re-read it. Now the switch runs
them first: back on the model, the next message reads only itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.paths import models_dir
from kvchat.service.chat import ChatService
from tests.tiny_models import FAMILIES, write_tiny


@pytest.fixture
def tiny(kvhome: Path) -> Path:
    folder = models_dir()
    folder.mkdir(parents=True)
    return write_tiny(FAMILIES["llama-gqa"], folder / "tiny-llama.gguf")


def test_switching_away_right_after_a_reply_and_back_reads_only_the_new_message(
    tiny: Path,
) -> None:
    service = ChatService(Settings(temperature=0, max_tokens=24, n_ctx=1024, n_threads=1))
    try:
        service.upkeep.deferred = True  # as the app: housekeeping waits for idle time
        session = service.sessions.new_session()
        service.send(session.id, "Name three colours.")
        last = service.send(session.id, "And three fruits?")
        assert service.upkeep.pending  # the settle and the snapshot write have not run
        service.models.switch_model(tiny)
        service.models.switch_model("bundled")
        after = service.send(session.id, "Thanks.")
        assert after.restore.source in ("ram", "disk"), after.restore
        # The whole last turn came back (its prompt and its reply), and only the new
        # message was read.
        assert after.restore.tokens >= last.tokens.prompt + last.tokens.generated
        assert after.tokens.reused == after.restore.tokens
        assert after.tokens.decoded == after.tokens.prompt - after.tokens.reused
    finally:
        service.close()
