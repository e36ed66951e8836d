"""Reply versions, service side, with the real model.

Regenerate keeps the earlier reply; switching back makes it current (the conversation, its
search and its exports read it), and the next turn reuses the context up to where the two
versions differ: it decodes that version's reply and the new message, never the history.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.errors import KvchatError
from tests.helpers import greedy_service

_WORDS = "river mountain library garden engine signal theory market history music".split()


def note(i: int, words: int = 120) -> str:
    """A long user message: a history worth not re-reading."""
    body = " ".join(_WORDS[(i * 3 + k * 7) % len(_WORDS)] for k in range(words))
    return f"Note {i}: {body}. Reply with one short sentence."


def test_switching_back_to_an_earlier_reply_reuses_the_shared_prefix(kvhome: Path) -> None:
    svc = greedy_service(kvhome, n_ctx=2048)
    try:
        sid = svc.start(note(0)).session_id
        svc.send(sid, note(1))
        asked = svc.send(sid, "Name one colour and say why you like it.")
        reply_id = asked.message_id
        assert reply_id is not None and svc.sessions.reply_versions(reply_id) == (1, 1)

        again = svc.regenerate(sid, temperature=1.2, seed=11)
        assert again.message_id == reply_id  # the same message, a second version
        assert again.reply != asked.reply
        assert svc.sessions.reply_versions(reply_id) == (2, 2)
        assert svc.sessions.messages(sid)[-1].content == again.reply
        assert svc.sessions.switch_version(reply_id, +1) is None  # already the newest

        shown = svc.sessions.switch_version(reply_id, -1)
        assert shown is not None and shown.content == asked.reply
        assert svc.sessions.reply_versions(reply_id) == (1, 2)
        assert svc.sessions.switch_version(reply_id, -1) is None  # the first version
        assert [m.content for m in svc.sessions.messages(sid)][-1] == asked.reply
        exported = json.loads(svc.sessions.export(sid, "json"))  # exports hold current versions
        assert exported["messages"][-1]["content"] == asked.reply
        assert again.reply not in svc.sessions.export(sid, "md")

        after = svc.send(sid, "Thanks.")

        # The context held the second version; the prompt has the first: the turn reused
        # everything up to the reply and decoded the first version and the new message.
        history = again.tokens.prompt  # the prompt up to the reply (the same for both)
        assert after.restore.source == "hot"
        assert history <= after.tokens.reused < history + svc.engine.count_tokens(asked.reply)
        new_part = svc.engine.count_tokens(asked.reply) + svc.engine.count_tokens("Thanks.")
        assert after.tokens.decoded == after.tokens.prompt - after.tokens.reused
        assert after.tokens.decoded <= new_part + 16  # + the template's few markers
        assert history > 300  # a history worth not re-reading, and it was not

        # Versions of an earlier reply no longer switch: later messages answer it.
        with pytest.raises(KvchatError, match="only the last reply"):
            svc.sessions.switch_version(reply_id, +1)
    finally:
        svc.close()
