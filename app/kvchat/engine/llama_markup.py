"""Template markup for the llama.cpp engine: where the vocabulary's special tokens are spelled
in rendered template text, defanging those spellings in message text, and gathering the
plain text between two special tokens to be tokenized as one string."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import llama_cpp

from kvchat.engine.api import split_spellings

# Tokens that llama.cpp parses out of text when asked to (``special=True``).
SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
# A message's fields that hold text (a person's, a file's, a model's), never markup.
TEXT_FIELDS = ("content", "reasoning_content")
# What C's isspace() strips next to a token with the LSTRIP/RSTRIP attribute.
C_SPACE = " \t\n\v\f\r"


class Special:
    """A special token: its id, and whether llama.cpp strips whitespace beside it."""

    __slots__ = ("id", "lstrip", "rstrip")

    def __init__(self, token: int, attr: int) -> None:
        self.id = token
        self.lstrip = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP)
        self.rstrip = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)


class Markup:
    """Splits template text at the spellings of the vocabulary's special tokens.

    The same tokens llama.cpp parses with ``special=True`` (control, user-defined and
    unknown), the longest spelling first where two could match at one place.
    """

    def __init__(self, vocab: Any) -> None:
        found: dict[str, Special] = {}
        for token in range(int(llama_cpp.llama_vocab_n_tokens(vocab))):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, token))
            if not attr & SPECIAL_ATTRS:
                continue
            raw = llama_cpp.llama_vocab_get_text(vocab, token)
            try:
                text = raw.decode("utf-8") if raw else ""
            except UnicodeDecodeError:
                continue
            if text and text not in found:
                found[text] = Special(token, attr)
        self.tokens = found
        spellings = sorted(found, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, spellings))) if spellings else None

    def defang(self, text: str) -> str:
        """``text`` with a word joiner after the first character of every special token's
        spelling in it, so no tokenizer can read one there."""
        if self._pattern is None:
            return text
        for _ in range(len(text) + 1):
            fixed = self._pattern.sub(break_spelling, text)
            if fixed == text:
                break
            text = fixed
        return text

    def split(self, text: str, shortest: int = 1) -> Iterator[tuple[str, Special | None]]:
        """``(text, None)`` for plain text and ``(spelling, token)`` for a special token
        (spelled in at least ``shortest`` characters; shorter spellings stay text)."""
        for piece, special in split_spellings(self._pattern, text, shortest):
            yield piece, self.tokens[piece] if special else None


def break_spelling(match: re.Match[str]) -> str:
    """A special token's spelling with a word joiner after its first character (a
    one-character spelling cannot be broken: it stays)."""
    text = match.group()
    return text if len(text) < 2 else text[0] + "\u2060" + text[1:]


class TextRun:
    """The text between two special tokens, gathered to be tokenized as one string."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.strip_next = False  # the last special token strips the whitespace after it

    def add(self, text: str) -> None:
        if self.strip_next:
            text = text.lstrip(C_SPACE)
            self.strip_next = not text
        if text:
            self.parts.append(text)

    def strip_end(self) -> None:
        text = "".join(self.parts).rstrip(C_SPACE)
        self.parts = [text] if text else []

    def take(self) -> str:
        text = "".join(self.parts)
        self.parts = []
        return text


class ChatTokens:
    """How :class:`kvchat.engine.llama.LlamaEngine` turns messages into prompt tokens: it
    holds one, built on the engine's template renderer, its text tokenizer and BOS rule."""

    def __init__(
        self,
        vocab: Any,
        render: Callable[[Sequence[dict[str, str]]], str],
        tokenize: Callable[[str], list[int]],
        bos: Callable[[str], int | None],
    ) -> None:
        """``bos(rendered)``: the BOS id to put before a rendering, or None for none."""
        self.render = render
        self.tokenize = tokenize
        self._bos = bos
        self._markup = Markup(vocab)
        # Stands in for message i's content while the template renders: private-use
        # characters and a random part, so no message text can contain or forge one.
        self._slot_id = secrets.token_hex(8)
        self._slot = f"\ue000{self._slot_id}:"
        self._slots = re.compile(re.escape(self._slot) + r"(\d+)\ue001")

    def safe_tools(self, tools: Any) -> Any:
        """Tools for a template's ``tools=`` (names, descriptions and schemas from a tool
        server) with every special token's spelling in their strings broken: the template
        writes them as its own text, so a ``<|im_end|>`` in a description must not be one."""
        if isinstance(tools, str):
            return self._markup.defang(tools)
        if isinstance(tools, dict):
            return {self.safe_tools(k): self.safe_tools(v) for k, v in tools.items()}
        if isinstance(tools, list | tuple):
            return [self.safe_tools(v) for v in tools]
        return tools

    def _start(self, rendered: str) -> list[int]:
        bos = self._bos(rendered)
        return [] if bos is None else [bos]

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``: only the template's own markup makes control tokens.

        The template is rendered with each message's content replaced by a slot marker; the
        rendering is cut at the markers, and the template's pieces are split at the spellings
        of the vocabulary's special tokens (as llama.cpp's ``special=True`` does). The text
        between two special tokens (template text and message content together, as one
        string, so the tokens are those of a plain tokenization) is tokenized with
        ``special=False``. So ``<|im_end|>`` typed, pasted, imported or in a system prompt
        is eight ordinary tokens, never the end of a turn. Deterministic: the same messages
        give the same ids, whatever the markers were.

        A template that alters or drops a message's content (so a marker is missing or
        changed) is rendered over the real messages instead, with every special token's
        spelling in them broken by a word joiner (U+2060), and tokenized whole.
        """
        texts: list[str] = []  # every message's content, then its reasoning where it has one
        stand_ins: list[dict[str, str]] = []
        required: set[int] = set()
        for message in messages:
            stand_in = dict(message)
            for key in TEXT_FIELDS:
                if key != "content" and not message.get(key):
                    continue
                stand_in[key] = f"{self._slot}{len(texts)}\ue001"
                if key == "content":
                    required.add(len(texts))
                texts.append(str(message.get(key) or ""))
            stand_ins.append(stand_in)
        rendered = self.render(stand_ins)
        pieces = self._slots.split(rendered)
        found = [int(index) for index in pieces[1::2]]
        # Every content exactly once; reasoning at most once (a template may drop it).
        if (
            set(found) & required != required
            or len(found) != len(set(found))
            or any(self._slot_id in p for p in pieces[::2])
        ):
            return self._defanged_tokens(messages)
        tokens = self._start(rendered)
        run = TextRun()
        for index, piece in enumerate(pieces):
            if index % 2:  # a message's content or reasoning
                run.add(texts[int(piece)])
            else:
                self._add_markup(piece, run, tokens)
        tokens += self.tokenize(run.take())
        return tokens

    def _add_markup(self, text: str, run: TextRun, tokens: list[int], shortest: int = 1) -> None:
        """Template text: its special tokens' spellings (of ``shortest`` characters or more)
        become their ids, each ending the text run before it; the rest joins ``run``."""
        for plain, special in self._markup.split(text, shortest):
            if special is None:
                run.add(plain)
                continue
            if special.lstrip:
                run.strip_end()
            tokens += self.tokenize(run.take())
            tokens.append(special.id)
            run.strip_next = special.rstrip

    def _defanged_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt of a template that changes message text: the real messages rendered
        with every special token's spelling in their content broken, read like template text.

        Never through llama.cpp's ``special=True``: a one-character spelling cannot be
        broken, so only spellings of two or more characters become special tokens here (a
        template's own one-character special token is read as text in this rare case).
        """
        safe = [
            {**m, **{k: self._markup.defang(str(m[k] or "")) for k in TEXT_FIELDS if k in m}}
            for m in messages
        ]
        rendered = self.render(safe)
        tokens = self._start(rendered)
        run = TextRun()
        self._add_markup(rendered, run, tokens, shortest=2)
        tokens += self.tokenize(run.take())
        return tokens
