"""Thinking models: a reply's reasoning is kept apart from its answer, exported in every
format (and left out when asked), imported back from JSON, and the next turn decodes only
the new message although the template renders the previous reply without its reasoning;
a session turns thinking off through the template's own switch.

The model is the bundled one with chat templates written here that behave as the thinking
families' do (the real ones are the models' own files): one that keeps a reply's reasoning
only after the last question (as Qwen3's), one whose generation prompt opens the think
block (as the DeepSeek-R1 distills'), and a harmony one (as gpt-oss's). The reply's
reasoning is forced with a grammar, so the real engine generates it token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.service.chat import ChatService

# After the last question only (Qwen3's rule), ChatML markup the bundled model knows.
KEEP_AFTER_LAST_QUESTION = """\
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if loop.index0 > ns.last and m.reasoning_content is defined and m.reasoning_content -%}
<think>
{{ m.reasoning_content }}
</think>

{% endif -%}
{{ m.content }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
<|im_start|>assistant
"""

# The generation prompt opens the think block; earlier replies keep only what follows it.
OPENS_THINKING = """\
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] | trim }}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor -%}
<|im_start|>assistant
<think>
"""

HARMONY = """\
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- else -%}
<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
<|start|>assistant"""

REASONING = "Two and two make four."
ANSWER = "Four."


def forced(text: str) -> str:
    """A grammar whose only sentence is ``text``."""
    return "root ::= " + json.dumps(text)


def service_on(home: Path, template: str, tmp_path: Path) -> ChatService:
    path = tmp_path / "template.jinja"
    path.write_text(template, encoding="utf-8")
    settings = load_settings(
        chat_template=str(path), n_ctx=2048, temperature=0.0, max_tokens=96, n_threads=1
    )
    return ChatService(settings, home=home)


# --- turns with the real engine ------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "written"),
    [
        (KEEP_AFTER_LAST_QUESTION, f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"),
        (OPENS_THINKING, f"{REASONING}\n</think>\n\n{ANSWER}"),
        (
            HARMONY,
            f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
            f"<|channel|>final<|message|>{ANSWER}",
        ),
    ],
    ids=["keep-after-last-question", "opens-thinking", "harmony"],
)
def test_reasoning_is_stored_apart_and_the_next_turn_decodes_only_the_new_message(
    kvhome: Path, tmp_path: Path, template: str, written: str
) -> None:
    service = service_on(kvhome, template, tmp_path)
    try:
        session = service.sessions.new_session().id
        first = service.send(session, "What is two and two?", grammar=forced(written))
        assert (first.reasoning, first.reply) == (REASONING, ANSWER)
        stored = service.sessions.messages(session)[-1]
        assert (stored.reasoning, stored.content) == (REASONING, ANSWER)
        assert first.to_json()["reasoning"] == REASONING
        # The template renders the reply without its reasoning next turn: the context
        # held it as generated, so those tokens are re-rendered (and settled now).
        assert first.tokens.rerendered > 10
        fork = service.sessions.fork(session).id
        second = service.send(session, "And three and three?")
        assert second.tokens.decoded < 64, second.summary()
        fresh = service.send(fork, "And three and three?", no_restore=True)
        assert fresh.tokens.reused == 0
        assert second.reply == fresh.reply  # greedy: the settled KV is a full prefill's
    finally:
        service.close()


def test_reasoning_goes_into_every_export_and_can_be_left_out(kvhome: Path, tmp_path: Path) -> None:
    service = service_on(kvhome, KEEP_AFTER_LAST_QUESTION, tmp_path)
    try:
        session = service.sessions.new_session().id
        written = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
        service.send(session, "What is two and two?", grammar=forced(written))
        as_json = json.loads(service.sessions.export(session, "json"))
        reply = as_json["messages"][-1]
        assert (reply["content"], reply["reasoning_content"]) == (ANSWER, REASONING)
        markdown = service.sessions.export(session, "md")
        assert f"> **Reasoning**\n>\n> {REASONING}\n\n{ANSWER}" in markdown
        page = service.sessions.export(session, "html")
        assert '<details class="reasoning"><summary>Reasoning</summary>' in page
        assert REASONING in page and "<think>" not in page
        for fmt in ("json", "md", "html"):
            assert REASONING not in service.sessions.export(session, fmt, reasoning=False)
    finally:
        service.close()


def test_a_json_export_imports_back_with_its_reasoning(kvhome: Path, tmp_path: Path) -> None:
    from kvchat.transfer import import_file

    service = service_on(kvhome, KEEP_AFTER_LAST_QUESTION, tmp_path)
    try:
        session = service.sessions.new_session().id
        written = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
        service.send(session, "What is two and two?", grammar=forced(written))
        exported = tmp_path / "session.json"
        exported.write_text(service.sessions.export(session, "json"), encoding="utf-8")
        imported = import_file(service, exported).sessions[0].session
        before = [(m.role, m.content, m.reasoning) for m in service.sessions.messages(session)]
        after = [(m.role, m.content, m.reasoning) for m in service.sessions.messages(imported)]
        assert after == before and after[-1] == ("assistant", ANSWER, REASONING)
    finally:
        service.close()


def test_kvchat_export_leaves_reasoning_out_when_asked(kvhome: Path, tmp_path: Path, cli) -> None:
    chat = tmp_path / "chat.json"
    chat.write_text(
        json.dumps(
            [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "The answer.", "reasoning_content": "Why."},
            ]
        ),
        encoding="utf-8",
    )
    imported = cli(kvhome, "import", str(chat), "--json")
    session = json.loads(imported.stdout)["sessions"][0]["session"]
    kept = cli(kvhome, "export", session, "--format", "md").stdout
    assert "> **Reasoning**\n>\n> Why.\n\nThe answer." in kept
    left = cli(kvhome, "export", session, "--format", "md", "--no-reasoning").stdout
    assert "Why." not in left and "The answer." in left


# Qwen3's switch: with thinking off, the generation prompt holds an empty think block.
SWITCHED = (
    KEEP_AFTER_LAST_QUESTION
    + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)


def test_a_session_turns_thinking_off_through_the_templates_own_switch(
    kvhome: Path, tmp_path: Path, cli
) -> None:
    service = service_on(kvhome, SWITCHED, tmp_path)
    try:
        assert service.host.thinking_switch.keyword == "enable_thinking"
        quiet = service.sessions.new_session().id
        service.sessions.configure(quiet, settings={"think": False})
        off = service.send(quiet, "Hi", max_tokens=2)
        engine = service.engine
        prompt = engine.tokens[: off.tokens.prompt]
        assert "<think>\n\n</think>" in engine.llm.detokenize(prompt).decode()
        thinking = service.sessions.new_session().id
        service.sessions.configure(thinking, settings={"think": True})
        on = service.send(thinking, "Hi", max_tokens=2)
        assert "</think>" not in engine.llm.detokenize(engine.tokens[: on.tokens.prompt]).decode()
        assert on.tokens.prompt < off.tokens.prompt
    finally:
        service.close()
    plain = cli(kvhome, "ask", "Hi", "--no-think", "--max-tokens", "2", "--temperature", "0")
    assert "no thinking switch" in plain.stderr  # the bundled model's own template has none
