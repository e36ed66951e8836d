"""A conversation with a tool's result goes on with an OpenAI-compatible server as the
engine: such a server is sent roles and contents only, and a ``tool`` role without its call
would be refused, so the result goes as the user's turn, labelled with the tool (a local
server in a thread records the request)."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from kvchat.store.tools_sql import ToolRecord
from tests.faults.test_openai_boundary import HostileServer


def test_a_tool_result_is_sent_as_the_user_s_labelled_turn(kvhome: Path) -> None:
    server = HostileServer()
    try:
        settings = load_settings(
            engine="openai", openai_url=f"{server.url}/v1", max_tokens=8, temperature=0.0
        )
        service = ChatService(settings, home=kvhome)
        try:
            session = service.sessions.new_session().id
            service.store.add_message(session, "user", "Add 2 and 3.")
            service.store.add_message(
                session, "assistant", '<tool_call>{"name": "demo.add"}</tool_call>'
            )
            record = ToolRecord(0, "demo.add", "c1", '{"a": 2, "b": 3}', False, False, "5", 0.1)
            service.store.add_tool_message(session, "5", record)
            report = service.send(session, "Thanks.")
            assert report.reply == "Hello."
            sent = json.loads(server.bodies[-1])["messages"]
            assert [m["role"] for m in sent] == ["user", "assistant", "user", "user"]
            assert sent[2] == {"role": "user", "content": "Tool result (demo.add):\n5"}
            roles = [m.role for m in service.store.messages(session)]
            assert roles == ["user", "assistant", "tool", "user", "assistant"]  # stored as is
        finally:
            service.close()
    finally:
        server.close()
