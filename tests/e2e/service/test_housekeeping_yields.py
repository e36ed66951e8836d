"""Housekeeping after a reply (the settle and the snapshot write) yields to a new message.

Real model, in-process: a message that arrives while a reply streams makes the settle stop
before its first batch, so the next turn reuses the context's valid prefix (the prompt
before the reply) and decodes the reply and the new message; its greedy reply equals a
full prefill's. A UI that defers housekeeping finishes it later, from where it stopped.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import greedy_service as service

FIRST = "Name three colours of the rainbow."
SECOND = "Which of them is the warmest?"
THIRD = "And the coldest?"


def test_a_message_during_the_reply_skips_the_settle_and_the_next_turn_reads_the_rest(
    kvhome: Path,
) -> None:
    svc = service(kvhome)
    try:
        first = svc.start(FIRST)
        sid = first.session_id
        # The user sends the next message while this reply streams: the UI asks to yield.
        second = svc.send(sid, SECOND, on_token=lambda _piece: svc.upkeep.interrupt())
        assert second.message_id is not None and second.tokens.generated > 0
        assert second.snapshot.bytes == 0  # the snapshot write yielded too
        assert svc.upkeep.pending

        third = svc.send(sid, THIRD)

        assert not svc.upkeep.pending
        assert third.restore.source == "hot"
        # The settle never ran: the context kept only the prompt before the reply, so this
        # turn re-reads the reply (as a full prefill would) and the new message.
        assert third.tokens.reused == second.tokens.prompt
        assert third.tokens.decoded == third.tokens.prompt - second.tokens.prompt
        assert third.tokens.decoded > second.tokens.generated
        assert third.snapshot.bytes > 0  # this turn's housekeeping ran

        # Its greedy reply is a full prefill's: the same history read from nothing.
        baseline = svc.regenerate(sid, no_restore=True)
        assert baseline.tokens.reused == 0
        assert baseline.reply == third.reply
    finally:
        svc.close()


def test_deferred_housekeeping_finishes_later_and_the_next_turn_decodes_only_the_message(
    kvhome: Path,
) -> None:
    svc = service(kvhome)
    try:
        svc.upkeep.deferred = True
        first = svc.start(FIRST)
        sid = first.session_id
        assert first.snapshot.bytes == 0 and svc.upkeep.pending

        # A new message is waiting: the idle UI's housekeeping yields at once.
        svc.upkeep.interrupt()
        waited = svc.upkeep.run_pending()
        assert not waited.finished and waited.settled == 0 and waited.snapshot is None
        assert svc.upkeep.pending
        svc.upkeep.allow()  # (the message went away; the UI goes idle again)

        done = svc.upkeep.run_pending()
        assert done.finished and not svc.upkeep.pending
        assert done.snapshot is not None and done.snapshot.bytes > 0
        # The reply and the template's opening of the next user turn, re-read as one batch.
        assert done.settled > first.tokens.generated

        second = svc.send(sid, SECOND)
        assert second.restore.source == "hot"
        # The context holds the next prompt up to the user's words: only they are decoded.
        assert second.tokens.reused == first.tokens.prompt + done.settled
        assert second.tokens.decoded == second.tokens.prompt - second.tokens.reused
        assert second.tokens.decoded < 24
    finally:
        svc.close()


def test_a_service_closed_with_the_settle_pending_saves_the_valid_prefix(kvhome: Path) -> None:
    svc = service(kvhome)
    try:
        first = svc.start(FIRST)
        sid = first.session_id
        second = svc.send(sid, SECOND, on_token=lambda _piece: svc.upkeep.interrupt())
        assert svc.upkeep.pending
    finally:
        svc.close()

    svc = service(kvhome)
    try:
        third = svc.send(sid, THIRD)
        assert third.restore.source == "disk"
        assert third.restore.tokens == second.tokens.prompt  # not the unsettled reply
        assert third.tokens.reused == second.tokens.prompt
        baseline = svc.regenerate(sid, no_restore=True)
        assert baseline.reply == third.reply
    finally:
        svc.close()


def test_deleting_a_session_removes_its_kv_and_keeps_what_a_branch_shares(kvhome: Path) -> None:
    svc = service(kvhome)
    try:
        parent = svc.start("Tell me about rivers.").session_id
        first_reply = svc.sessions.messages(parent)[-1].id
        svc.send(parent, "And what about lakes and the fish that live in them?")
        branch = svc.sessions.fork(parent, at_message=first_reply).id
        svc.send(branch, "And seas?")  # borrows the shared prefix, writes its own chunks
        cold = svc.host.local_tiers.cold
        parent_row, branch_row = svc.store.get_snapshot(parent), svc.store.get_snapshot(branch)
        assert parent_row is not None and branch_row is not None
        shared = set(parent_row.chunk_keys) & set(branch_row.chunk_keys)
        assert shared and set(parent_row.chunk_keys) - shared, "no prefix shared or no own chunks"
        parent_files, branch_files = set(cold.files(parent_row)), set(cold.files(branch_row))
        svc.sessions.delete(parent)
        assert svc.store.get_snapshot(parent) is None
        assert not any(p.exists() for p in parent_files - branch_files)  # its own chunks: gone
        assert all(p.exists() for p in branch_files)  # what the branch uses: kept
    finally:
        svc.close()
    again = service(kvhome)
    try:
        turn = again.send(branch, "And oceans?")
        assert turn.restore.source == "disk" and turn.tokens.decoded < 32
    finally:
        again.close()
