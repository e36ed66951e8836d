"""Session transcripts as Markdown, JSON (OpenAI-style messages) and self-contained HTML."""

from __future__ import annotations

import html
import json
import re
from typing import Literal

from kvchat import __version__
from kvchat.store import Message, Session

ExportFormat = Literal["md", "json", "html"]
FORMATS: tuple[ExportFormat, ...] = ("md", "json", "html")
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_TOP_HEADING = re.compile(r" {0,3}#{1,2}(?:[ \t]|$)")


def markdown_block(text: str) -> str:
    """A message's Markdown, contained: it cannot end the transcript's structure.

    Outside code fences, a line that would be a level-1 or level-2 heading (the
    transcript's own title and role headings) is escaped; a fence the message leaves
    open is closed, so the next role heading is not swallowed into a code block.
    """
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
            elif _TOP_HEADING.match(line):
                line = "\\" + line.lstrip(" ")
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
            if not line.strip().strip(fence[0]):
                fence = None
        out.append(line)
    if fence is not None:
        out.append(fence)
    return "\n".join(out)


def _flag(message: Message) -> str:
    """What a reply's heading says about how it ended, if anything: "partial" (stopped
    early), "stopped at the token limit"."""
    if message.partial:
        return "partial"
    if message.finish_reason == "length":
        return "stopped at the token limit"
    return ""


def quoted(text: str) -> str:
    """``text`` as a Markdown block quote (every line, blank ones too, so it stays one)."""
    return "\n".join(f"> {line}" if line else ">" for line in markdown_block(text).split("\n"))


def to_markdown(session: Session, messages: list[Message], reasoning: bool = True) -> str:
    """The transcript; a reply's reasoning (``reasoning``: kept) is a quoted section headed
    "Reasoning" before its answer."""
    title = " ".join(session.title.split())
    lines = [f"# {title}", "", f"_Session `{session.id}` · created {session.created}_", ""]
    if session.system_prompt:
        lines += ["## System", "", markdown_block(session.system_prompt), ""]
    for m in messages:
        flag = f" _({_flag(m)})_" if _flag(m) else ""
        lines += [f"## {ROLE_NAMES.get(m.role, m.role)}{flag}", ""]
        if reasoning and m.reasoning:
            lines += ["> **Reasoning**", ">", quoted(m.reasoning), ""]
        lines += [markdown_block(m.content), ""]
    return "\n".join(lines).rstrip() + "\n"


def to_json(session: Session, messages: list[Message], reasoning: bool = True) -> str:
    """OpenAI-style messages (a reply's reasoning as ``reasoning_content``) and kvchat's
    own fields."""
    chat: list[dict[str, object]] = []
    if session.system_prompt:
        chat.append({"role": "system", "content": session.system_prompt})
    for m in messages:
        item: dict[str, object] = {"role": m.role, "content": m.content}
        if reasoning and m.reasoning:
            item["reasoning_content"] = m.reasoning
        if m.partial:
            item["partial"] = True
        chat.append(item)
    document = {
        "format": "kvchat.session/1",
        "exported_by": f"kvchat {__version__}",
        "session": {
            "id": session.id,
            "title": session.title,
            "created": session.created,
            "updated": session.updated,
            "system_prompt": session.system_prompt,
            "settings": session.settings,
        },
        "messages": chat,
        "message_meta": [
            {
                "id": m.id,
                "created": m.created,
                "token_count": m.token_count,
                "finish_reason": m.finish_reason,
            }
            for m in messages
        ],
    }
    return json.dumps(document, ensure_ascii=False, indent=2) + "\n"


_CSS = """
body{font-family:system-ui,sans-serif;max-width:50rem;margin:2rem auto;padding:0 1rem;
line-height:1.5;color:#1d1d1f;background:#fafafa}
.msg{border-radius:.6rem;padding:.6rem 1rem;margin:.8rem 0;overflow-wrap:anywhere}
.user{background:#e3efff}.assistant{background:#fff;border:1px solid #ddd}
.system{background:#f3f3f3;font-style:italic;white-space:pre-wrap}
.role{font-weight:600;display:block}
.partial{color:#a15c00;font-weight:400}footer{color:#888;font-size:.8rem}
.body>:first-child{margin-top:.3rem}.body>:last-child{margin-bottom:0}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em;
background:#f0f0f3;border-radius:.25rem;padding:0 .2rem}
pre{background:#f6f8fa;border:1px solid #ddd;border-radius:.4rem;padding:.6rem .8rem;
overflow-x:auto}pre code{background:none;padding:0}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.2rem .5rem}
blockquote{margin:.5rem 0;padding-left:.8rem;border-left:3px solid #ccc;color:#555}
details.reasoning{color:#555;border-left:3px solid #ccc;padding-left:.8rem;margin:.3rem 0}
details.reasoning summary{cursor:pointer;font-style:italic}
"""


def markdown_html(text: str, *, typed: bool = False) -> str:
    """A message's Markdown as HTML, as the app renders it (markdown-it, the same library
    and rules): raw HTML and character references stay text (escaped), images stay links
    (the page loads nothing), unsafe link schemes are dropped by markdown-it. ``typed``
    (your messages): every line break is kept, as in the app."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("gfm-like", {"html": False, "breaks": typed})
    parser.disable(["html_inline", "html_block", "entity", "image"])
    return str(parser.render(text))


def to_html(session: Session, messages: list[Message], reasoning: bool = True) -> str:
    """One file, no scripts, no external resources; every piece of text is escaped and the
    messages' Markdown rendered (code blocks in monospace; ``dir="auto"`` for any script).
    A reply's reasoning is a collapsed ``<details>`` block before its answer."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(session.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(session.title)}</h1>",
        f"<p><small>Session {esc(session.id)} · created {esc(session.created)}</small></p>",
    ]
    if session.system_prompt:
        parts.append(
            '<div class="msg system" dir="auto"><span class="role">System</span>'
            f"{esc(session.system_prompt)}</div>"
        )
    for m in messages:
        flag = f' <span class="partial">({_flag(m)})</span>' if _flag(m) else ""
        role = esc(ROLE_NAMES.get(m.role, m.role))
        body = markdown_html(m.content, typed=m.role == "user")
        if reasoning and m.reasoning:
            thought = markdown_html(m.reasoning)
            body = (
                f'<details class="reasoning"><summary>Reasoning</summary>{thought}</details>' + body
            )
        parts.append(
            f'<div class="msg {esc(m.role)}" dir="auto"><span class="role">{role}{flag}</span>'
            f'<div class="body">{body}</div></div>'
        )
    parts.append(f"<footer>Exported by kvchat {esc(__version__)}</footer></body></html>")
    return "\n".join(parts) + "\n"


def export_session(
    session: Session, messages: list[Message], fmt: ExportFormat, reasoning: bool = True
) -> str:
    """The session in ``fmt``; ``reasoning`` False leaves thinking models' reasoning out."""
    if fmt == "md":
        return to_markdown(session, messages, reasoning)
    if fmt == "json":
        return to_json(session, messages, reasoning)
    return to_html(session, messages, reasoning)
