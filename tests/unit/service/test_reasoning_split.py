"""A reply's reasoning is split from its answer: think tags, harmony channels, a stream that
never shows half a marker as answer, the style read from what the template renders, and
other apps' reasoning imported apart from the answer. Model-free."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.config import load_settings
from kvchat.service.chat import ChatService
from kvchat.service.reasoning import (
    NO_REASONING,
    ReasoningStream,
    ReasoningStyle,
    detect_style,
    split_reasoning,
)
from tests.e2e.reasoning.test_reasoning import HARMONY, KEEP_AFTER_LAST_QUESTION, OPENS_THINKING

# --- the parts, without the model ---------------------------------------------------------


def test_think_tags_split_reasoning_from_the_answer() -> None:
    tags = ReasoningStyle("think")
    assert split_reasoning("<think>\nR1\nR2\n</think>\n\nThe answer", tags) == (
        "R1\nR2",
        "The answer",
    )
    assert split_reasoning("No thinking here.", tags) == ("", "No thinking here.")
    assert split_reasoning("<think>\nstill going", tags) == ("still going", "")  # cut short
    inside = ReasoningStyle("think", opens_inside=True)
    assert split_reasoning("R\n</think>\n\nA", inside) == ("R", "A")
    assert split_reasoning("R only", inside) == ("R only", "")
    assert split_reasoning("<think>x</think>y", NO_REASONING) == ("", "<think>x</think>y")


def test_harmony_channels_split_analysis_from_final() -> None:
    harmony = ReasoningStyle("harmony")
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Answer.<|return|>"
    )
    assert split_reasoning(text, harmony) == ("Think.", "Answer.")
    assert split_reasoning("<|channel|>final<|message|>Only.", harmony) == ("", "Only.")


def test_a_stream_never_shows_half_a_marker_as_answer() -> None:
    stream = ReasoningStream(ReasoningStyle("think"))
    shown_reasoning, shown_answer = "", ""
    for piece in ["<th", "ink>\nI re", "ason</th", "ink>\n\nOK", " then."]:
        reasoning, answer = stream.feed(piece)
        shown_reasoning += reasoning
        shown_answer += answer
        assert "<" not in shown_answer
    assert (shown_reasoning.strip(), shown_answer) == ("I reason", "OK then.")
    assert stream.answer == "OK then." and not stream.in_reasoning


def test_the_style_is_read_from_what_the_template_renders() -> None:
    from jinja2 import Environment

    def renderer(template: str):
        compiled = Environment().from_string(template)
        return lambda messages: compiled.render(messages=messages)

    assert detect_style(renderer(KEEP_AFTER_LAST_QUESTION)) == ReasoningStyle("think")
    assert detect_style(renderer(OPENS_THINKING)) == ReasoningStyle("think", opens_inside=True)
    assert detect_style(renderer(HARMONY)) == ReasoningStyle("harmony")
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_style(renderer(plain)) == NO_REASONING


def test_other_apps_reasoning_is_imported_apart_from_the_answer(
    kvhome: Path, tmp_path: Path
) -> None:
    """OpenAI-style ``reasoning_content``, a reply that starts with a think block, and a
    ChatGPT export's thoughts: each lands in the reasoning, never in the answer."""
    from kvchat.transfer import import_file

    openai_style = tmp_path / "openai.json"
    openai_style.write_text(
        json.dumps(
            [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
            ]
        ),
        encoding="utf-8",
    )

    def node(key: str, parent: str | None, role: str, content: dict) -> dict:
        message = {"author": {"role": role}, "content": content, "create_time": 1.7e9}
        return {"id": key, "parent": parent, "children": [], "message": message}

    chain = [
        node("a", None, "user", {"content_type": "text", "parts": ["Q"]}),
        node(
            "b",
            "a",
            "assistant",
            {"content_type": "thoughts", "thoughts": [{"summary": "Plan", "content": "Think."}]},
        ),
        node("c", "b", "assistant", {"content_type": "reasoning_recap", "content": "Thought"}),
        node("d", "c", "assistant", {"content_type": "text", "parts": ["A"]}),
    ]
    for parent, child in zip(chain, chain[1:]):
        parent["children"] = [child["id"]]
    chatgpt = tmp_path / "conversations.json"
    chatgpt.write_text(
        json.dumps([{"title": "T", "mapping": {n["id"]: n for n in chain}, "current_node": "d"}]),
        encoding="utf-8",
    )
    service = ChatService(load_settings(), home=kvhome)
    try:
        first = import_file(service, openai_style).sessions[0].session
        assert [(m.content, m.reasoning) for m in service.sessions.messages(first)] == [
            ("Q1", ""),
            ("A1", "R1"),
            ("Q2", ""),
            ("A2", "R2"),
        ]
        second = import_file(service, chatgpt).sessions[0].session
        assert [(m.content, m.reasoning) for m in service.sessions.messages(second)] == [
            ("Q", ""),
            ("A", "Plan\n\nThink."),
        ]
    finally:
        service.close()
