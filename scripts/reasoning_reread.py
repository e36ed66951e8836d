"""What a thinking model's template makes the next turn re-read, with and without the settle.

For each kind of template (those of tests/test_reasoning.py, which behave as Qwen3's, the
DeepSeek-R1 distills' and gpt-oss's do, and the bundled model's own, which has no
reasoning) the bundled model answers one question with a forced reasoning of about 60
tokens, then a second question is asked twice: once after the settle ran (what the app
does while you read), once with the settle skipped. Prints a Markdown table.
Usage: python scripts/reasoning_reread.py [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.config import load_settings  # noqa: E402
from kvchat.service.chat import ChatService  # noqa: E402
from tests.test_reasoning import (  # noqa: E402
    HARMONY,
    KEEP_AFTER_LAST_QUESTION,
    OPENS_THINKING,
    forced,
)

THOUGHT = (
    "The user asks for two and two. Two and two make four, as counting on fingers shows: "
    "one, two, then three, four. No trick is hidden in the question, so the answer is four."
)
KINDS = [
    (
        "keeps reasoning after the last question (Qwen3)",
        KEEP_AFTER_LAST_QUESTION,
        f"<think>\n{THOUGHT}\n</think>\n\nFour.",
    ),
    (
        "opens the think block, drops it from history (R1 distills)",
        OPENS_THINKING,
        f"{THOUGHT}\n</think>\n\nFour.",
    ),
    (
        "harmony channels (gpt-oss)",
        HARMONY,
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
        "<|channel|>final<|message|>Four.",
    ),
    ("no reasoning (the bundled model's own)", None, "Four."),
]


def run(template: str | None, written: str, settle: bool, threads: int) -> tuple[int, int, int]:
    """(reasoning tokens the reply held, tokens re-rendered, next turn's decoded)."""
    with tempfile.TemporaryDirectory() as home:
        extra = {}
        if template is not None:
            path = Path(home) / "template.jinja"
            path.write_text(template, encoding="utf-8")
            extra["chat_template"] = str(path)
        settings = load_settings(
            n_ctx=2048, temperature=0.0, max_tokens=160, n_threads=threads, **extra
        )
        service = ChatService(settings, home=Path(home))
        service.upkeep.deferred = True
        try:
            session = service.sessions.new_session().id
            first = service.send(session, "What is two and two?", grammar=forced(written))
            if settle:
                service.upkeep.run_pending()
            second = service.send(session, "And three and three?", max_tokens=8)
            thought = service.engine.count_tokens(first.reasoning) if first.reasoning else 0
            return thought, first.tokens.rerendered, second.tokens.decoded
        finally:
            service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    question = len("And three and three?")
    print(
        f"| template | reasoning tokens | re-rendered | next turn decodes: settled | "
        f"not settled |  (the new message is ~{question // 4 + 8} tokens with its markup)"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, template, written in KINDS:
        thought, rerendered, settled = run(template, written, True, args.threads)
        _, _, unsettled = run(template, written, False, args.threads)
        print(f"| {name} | {thought} | {rerendered} | {settled} | {unsettled} |")


if __name__ == "__main__":
    main()
