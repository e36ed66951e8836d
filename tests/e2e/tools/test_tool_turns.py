"""Tool calls in a conversation, end to end on the bundled model (SmolLM2-135M), which a
llama.cpp grammar makes write a Hermes ``<tool_call>`` for ``add``: the call is approved,
run, stored as a tool message, and the decode after it reads only the result and the
template's few tokens (llama.cpp's count, exactly); the conversation then resumes from disk
with a greedy reply equal to a full prefill's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import llama_cpp._internals as internals
import pytest

from kvchat.config import load_settings
from kvchat.engine import common_prefix
from kvchat.service.chat import ChatService
from kvchat.service.tools import CallRequest, Decision
from kvchat.tools.api import ServerState, ToolResult, ToolSpec
from kvchat.tools.calls import CallFormat

# The reply the grammar allows: one Hermes call of demo.add with two small numbers.
ADD_CALL = (
    'root ::= "<tool_call>\\n{\\"name\\": \\"demo.add\\", \\"arguments\\": {\\"a\\": " num '
    '", \\"b\\": " num "}}\\n</tool_call>"\n'
    "num ::= [1-9] [0-9]?\n"
)


class PlainRunner:
    """A runner whose one tool adds (stands for the MCP client until it is used here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def servers(self) -> list[ServerState]:
        return [ServerState("demo", "stdio", True, "ask", "running", None, 1, "plain")]

    def tools(self) -> list[ToolSpec]:
        schema = {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        }
        return [ToolSpec("demo", "add", "Add two integers.", schema)]

    def call(
        self, qualified: str, arguments: dict[str, Any], timeout_s: float | None = None
    ) -> ToolResult:
        self.calls.append((qualified, arguments))
        text = str(int(arguments["a"]) + int(arguments["b"]))
        return ToolResult(text, text, False, False, 0.01)

    def close(self) -> None:
        pass


@pytest.fixture
def decoded_by_llama(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts: list[int] = []
    real = internals.llama_cpp.llama_decode

    def counting(ctx, batch):  # noqa: ANN001 - ctypes values
        counts.append(int(batch.n_tokens))
        return real(ctx, batch)

    monkeypatch.setattr(internals.llama_cpp, "llama_decode", counting)
    return counts


def test_a_model_made_call_is_approved_stored_and_read_alone(
    kvhome: Path, decoded_by_llama: list[int]
) -> None:
    settings = load_settings(n_ctx=2048, temperature=0.0, max_tokens=80, n_threads=1)
    service = ChatService(settings, home=kvhome)
    runner = PlainRunner()
    service.tools.attach(runner)
    service.tools.format = CallFormat.HERMES
    asked: list[CallRequest] = []

    def approve(request: CallRequest) -> Decision:
        asked.append(request)
        return "once"

    try:
        session = service.sessions.new_session().id
        decoded_by_llama.clear()
        turn = service.tools.send(
            session, "What is 2 plus 3? Use the add tool.", approve, grammar=ADD_CALL
        )
        [request] = asked
        assert request.qualified == "demo.add" and set(request.arguments) == {"a", "b"}
        total = request.arguments["a"] + request.arguments["b"]
        [step] = turn.steps
        assert step.result is not None and step.result.text == str(total)
        assert runner.calls == [("demo.add", request.arguments)]
        assert len(turn.reports) == 2 and turn.note is None
        messages = service.store.messages(session)
        assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2].content == str(total)
        [call] = service.store.tool_calls([messages[1].id])[messages[1].id]
        assert call.name == "demo.add" and json.loads(call.arguments) == request.arguments
        record = service.store.tool_records([messages[2].id])[messages[2].id]
        assert (record.name, record.full_text, record.is_error) == ("demo.add", str(total), False)
        assert record.call_id == call.call_id

        # The decode after the result: the tool message and the template's tokens, exactly.
        engine = service.engine.token_level()
        assert engine is not None
        chat = [m.as_chat() for m in messages[:2]]
        # What the settle left the context holding: the history up to the next user's words.
        first = engine.chat_tokens(chat + [{"role": "user", "content": "A"}])
        held = first[
            : common_prefix(first, engine.chat_tokens(chat + [{"role": "user", "content": "B"}]))
        ]
        prompt = engine.chat_tokens(chat + [messages[2].as_chat()])
        after = turn.reports[1].tokens
        assert after.prompt == len(prompt)
        assert after.reused == common_prefix(prompt, held)
        assert after.decoded == len(prompt) - after.reused
        template = after.decoded - engine.count_tokens(str(total))
        assert 0 < template <= 8
        print(
            f"after the result: reused {after.reused}, decoded {after.decoded} "
            f"(result {engine.count_tokens(str(total))} + template {template})"
        )
    finally:
        service.close()

    # The conversation with its call resumes from disk like any other: greedy after the
    # restore equals greedy after a full prefill (a copy of the home, read with no restore).
    copy = kvhome.parent / "prefilled"
    shutil.copytree(kvhome, copy)
    replies = []
    for home, no_restore in ((kvhome, False), (copy, True)):
        again = ChatService(settings, home=home)
        try:
            report = again.send(session, "And 4 plus 4?", no_restore=no_restore)
            assert report.restore.source == ("none" if no_restore else "disk")
            replies.append((report.reply, report.tokens.prompt))
        finally:
            again.close()
    assert replies[0] == replies[1]
