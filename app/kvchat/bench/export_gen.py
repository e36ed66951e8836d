"""A generated ChatGPT ``conversations.json`` of any size, written as it goes (constant
memory): what ``kvchat bench --ui --sessions N --messages M`` imports, and the scale tests.

Every conversation is a chain of ``messages`` nodes under a hidden empty root, as ChatGPT
exports them; the text is deterministic (seeded) prose. One message in every
:data:`RARE_EVERY` holds :data:`RARE_WORD` (a search with a few hits); :data:`COMMON_WORD`
is in every message (a search with as many hits as there are messages).

:func:`write_long_export` writes one long conversation (what the scale bench switches to,
jumps into and streams a reply into): second in the sidebar, after the newest, with
:data:`JUMP_WORD` only in its first message.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

RARE_WORD = "zebra"
RARE_EVERY = 997
COMMON_WORD = "river"
_WORDS = (
    "memory cache token model context layer attention window mountain library garden "
    "village bridge lantern harbor meadow orchard signal pattern engine journal market "
    "winter summer planet castle forest valley letter answer question morning evening"
).split()
# The newest conversation's update time; each older one is a minute earlier.
NEWEST = 1_760_000_000.0
# Words in a user message / a reply.
SIZES = (30, 130)
# The long conversation: its title's start, and the word only its first message holds.
LONG_TITLE = "Long conversation:"
JUMP_WORD = "quokka"


def _text(rng: random.Random, words: int, rare: bool) -> str:
    picked = [rng.choice(_WORDS) for _ in range(words)]
    picked[rng.randrange(words)] = COMMON_WORD
    if rare:
        picked[rng.randrange(words)] = RARE_WORD
    sentence = " ".join(picked)
    return sentence[0].upper() + sentence[1:] + "."


def _reply(rng: random.Random, words: int, number: int) -> str:
    """A reply of about ``words`` words shaped as a model writes one: a sentence, a bold
    heading line, a list of four points, and in every third reply a short code block."""
    lead = _text(rng, max(4, words // 4), False)
    points = [_text(rng, max(3, words // 8), False) for _ in range(4)]
    rest = _text(rng, max(4, words - words // 4 - 4 * (words // 8)), False)
    parts = [lead, "", f"**{rng.choice(_WORDS).title()} {rng.choice(_WORDS)}**", ""]
    parts += [f"- {point}" for point in points]
    if number % 3 == 0:
        name = rng.choice(_WORDS)
        parts += ["", "```python", f"def {name}(x):", f'    return x + "{name}"', "```"]
    parts += ["", rest]
    return "\n".join(parts)


def conversation(
    number: int,
    messages: int,
    rng: random.Random,
    counter: list[int],
    *,
    sizes: tuple[int, int] = SIZES,
    rare: bool = True,
    updated: float | None = None,
    markdown: bool = False,
) -> dict[str, Any]:
    """Conversation ``number`` (0 = the newest) with ``messages`` user/assistant turns of
    ``sizes`` words; ``rare``: :data:`RARE_WORD` in every :data:`RARE_EVERY` th message;
    ``updated``: its update time (by default :data:`NEWEST` less a minute per number);
    ``markdown``: replies shaped as a model's (a list, some code: see :func:`_reply`)."""
    updated = NEWEST - 60.0 * number if updated is None else updated
    created = updated - 10.0 * messages
    mapping: dict[str, dict[str, Any]] = {
        "root": {"id": "root", "message": None, "parent": None, "children": ["n0"]}
    }
    for i in range(messages):
        node_id = f"n{i}"
        counter[0] += 1
        words = sizes[i % 2]
        if markdown and i % 2:
            text = _reply(rng, words, i // 2)
        else:
            text = _text(rng, words, rare and counter[0] % RARE_EVERY == 0)
        mapping[node_id] = {
            "id": node_id,
            "message": {
                "id": node_id,
                "author": {"role": "user" if i % 2 == 0 else "assistant"},
                "create_time": created + 10.0 * i,
                "content": {
                    "content_type": "text",
                    "parts": [text],
                },
                "metadata": {},
                "recipient": "all",
            },
            "parent": "root" if i == 0 else f"n{i - 1}",
            "children": [f"n{i + 1}"] if i + 1 < messages else [],
        }
    conv_id = f"bench-{number:06d}"
    return {
        "title": f"Conversation {number}: {rng.choice(_WORDS)} {rng.choice(_WORDS)}",
        "create_time": created,
        "update_time": updated,
        "mapping": mapping,
        "current_node": f"n{messages - 1}",
        "conversation_id": conv_id,
        "id": conv_id,
    }


def write_chatgpt_export(path: Path, sessions: int, messages: int, seed: int = 0) -> int:
    """Write ``sessions`` conversations of ``messages`` messages to ``path`` (oldest last,
    as ChatGPT does); returns the file's size in bytes."""
    rng = random.Random(seed)
    counter = [0]
    with path.open("w", encoding="utf-8") as out:
        out.write("[")
        for number in range(sessions):
            if number:
                out.write(",\n")
            out.write(json.dumps(conversation(number, messages, rng, counter)))
        out.write("]\n")
    return path.stat().st_size


def rare_hits(sessions: int, messages: int) -> int:
    """How many messages of such an export hold :data:`RARE_WORD`."""
    return sessions * messages // RARE_EVERY


def long_conversation(
    messages: int, sizes: tuple[int, int] = SIZES, seed: int = 1
) -> dict[str, Any]:
    """One conversation of ``messages`` messages titled :data:`LONG_TITLE`, updated between
    the newest conversation and the next (second in the sidebar); its replies are shaped
    as a model's (Markdown: a list, some code); its first message, and no other, holds
    :data:`JUMP_WORD` (and none holds :data:`RARE_WORD`)."""
    rng = random.Random(seed)
    data = conversation(
        0, messages, rng, [0], sizes=sizes, rare=False, updated=NEWEST - 30.0, markdown=True
    )
    first = data["mapping"]["n0"]["message"]["content"]["parts"]
    first[0] = f"The {JUMP_WORD} question. {first[0]}"
    data["title"] = f"{LONG_TITLE} {messages:,} messages"
    data["conversation_id"] = data["id"] = "bench-long"
    return data


def write_long_export(path: Path, messages: int, sizes: tuple[int, int] = SIZES) -> int:
    """Write an export of the one :func:`long_conversation` to ``path``; returns its size."""
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps([long_conversation(messages, sizes)]))
        out.write("\n")
    return path.stat().st_size
