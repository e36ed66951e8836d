"""The llama-server engine's prompts: the server's tokenizer and chat template, with
message text kept as text.

Everything goes through the server (``/tokenize``, ``/apply-template``), cached, so the
prompt's ids are the server's own; only the template's markup becomes control tokens.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

from kvchat.engine.api import split_spellings
from kvchat.engine.openai_wire import WireError
from kvchat.engine.server_http import ServerClient, ServerError
from kvchat.engine.server_wire import rendered, tokenized, tokenized_pieces
from kvchat.errors import KvchatError

# Cached tokenizations and renderings (the service asks for the same prefixes often).
_CACHE_ENTRIES = 2048


class ServerPrompts:
    """Tokens and chat-template renderings from one llama-server."""

    def __init__(self, client: ServerClient, props: dict[str, Any]) -> None:
        self.client = client
        self.props = props
        self._text_cache: dict[tuple[str, bool], list[int]] = {}
        self._render_cache: dict[str, str] = {}
        self._specials: dict[str, int] = {}
        self._specials_pattern: re.Pattern[str] | None = None
        self._learned: set[str] = set()
        self._bos: list[int] | None = None
        self._slot_id = secrets.token_hex(8)
        self._marker = f"\ue000{self._slot_id}:"
        self._markers = re.compile(re.escape(self._marker) + r"(\d+)\ue001")

    def _tokenize(self, text: str, parse_special: bool) -> list[int]:
        key = (text, parse_special)
        cached = self._text_cache.get(key)
        if cached is not None:
            return list(cached)
        if not text:
            return []
        reply = self.client.post(
            "/tokenize",
            {"content": text, "add_special": False, "parse_special": parse_special},
        )
        tokens = self._read(tokenized, reply, "/tokenize")
        if len(self._text_cache) >= _CACHE_ENTRIES:
            self._text_cache.clear()
        self._text_cache[key] = tokens
        return list(tokens)

    def _read(self, parse: Any, reply: Any, path: str) -> Any:
        """``parse(reply)`` (:mod:`kvchat.engine.server_wire`), or one ServerError line."""
        try:
            return parse(reply)
        except WireError as exc:
            raise self.client._bad_reply(exc.what, path) from None

    def tokenize(self, text: str) -> list[int]:
        """``text`` as text (``parse_special`` false): a control token's spelling stays characters."""
        return self._tokenize(text, parse_special=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The server's chat template over ``messages``, ending with the assistant's opening."""
        body = {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
        key = repr(body)
        cached = self._render_cache.get(key)
        if cached is not None:
            return cached
        try:
            reply = self.client.post("/apply-template", body)
        except ServerError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status != 401:
                raise KvchatError(
                    f"the server's chat template refused these messages: {exc}"
                ) from None
            raise
        prompt: str = self._read(rendered, reply, "/apply-template")
        if len(self._render_cache) >= _CACHE_ENTRIES:
            self._render_cache.clear()
        self._render_cache[key] = prompt
        return prompt

    def _learn_specials(self, markup: str) -> None:
        """Find the control tokens the template's markup spells (``<|im_start|>`` …): the
        tokens of ``markup`` read with ``parse_special`` whose spelling, read as text, is
        not that one token. Asked once per distinct piece of markup and token."""
        if markup in self._learned or not markup:
            return
        self._learned.add(markup)
        reply = self.client.post(
            "/tokenize",
            {"content": markup, "add_special": False, "parse_special": True, "with_pieces": True},
        )
        changed = False
        for token, piece in self._read(tokenized_pieces, reply, "/tokenize"):
            if len(piece) < 2 or piece in self._learned:
                continue
            self._learned.add(piece)
            if self._tokenize(piece, parse_special=False) != [token]:
                self._specials[piece] = token
                changed = True
        if changed:
            spellings = sorted(self._specials, key=len, reverse=True)
            self._specials_pattern = re.compile("|".join(map(re.escape, spellings)))

    def _split_markup(self, text: str) -> Iterator[tuple[str, int | None]]:
        """``(text, None)`` for plain text and ``(spelling, id)`` for a control token."""
        for piece, special in split_spellings(self._specials_pattern, text):
            yield piece, self._specials[piece] if special else None

    def _bos_tokens(self, rendered: str) -> list[int]:
        """[BOS] when the vocabulary adds one and the rendering does not spell it."""
        if self._bos is None:
            reply = self.client.post(
                "/tokenize", {"content": "", "add_special": True, "parse_special": True}
            )
            self._bos = self._read(tokenized, reply, "/tokenize")[:1]
        spelling = str(self.props.get("bos_token") or "")
        if not self._bos or (spelling and rendered.startswith(spelling)):
            return []
        return list(self._bos)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt for ``messages``: only the template's own markup makes control tokens.

        As the local engine does: the template is rendered with a marker in place of each
        message's content, cut at the markers; the markup is split at control-token
        spellings (learned from the server) and the text between two control tokens
        (markup and message content together) is tokenized as text. So a pasted
        ``<|im_end|>`` is characters, never the end of a turn. Deterministic.
        """
        contents = [str(m.get("content") or "") for m in messages]
        stand_ins = [{**m, "content": f"{self._marker}{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.render(stand_ins)
        pieces = self._markers.split(rendered)
        found = {int(index) for index in pieces[1::2]}
        if found != set(range(len(messages))) or any(self._slot_id in p for p in pieces[::2]):
            raise KvchatError(
                "the server's chat template changes message text: kvchat cannot keep "
                "control tokens out of it (start llama-server with another --chat-template)"
            )
        for markup in pieces[::2]:
            self._learn_specials(markup)
        tokens = self._bos_tokens(rendered)
        run: list[str] = []
        for index, piece in enumerate(pieces):
            if index % 2:
                run.append(contents[int(piece)])
                continue
            for text, special in self._split_markup(piece):
                if special is None:
                    run.append(text)
                    continue
                tokens += self.tokenize("".join(run))
                tokens.append(special)
                run = []
        tokens += self.tokenize("".join(run))
        return tokens
