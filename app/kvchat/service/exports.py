"""Session transcripts as Markdown, JSON (OpenAI-style messages) and self-contained HTML.

Each carries the conversation's documents (attachments): their name, kind, size, sha256
and the text the model read, at the start; a message a later document came with says so.
A compaction summary (the model reads it instead of the messages up to one) follows the
last message it stands for, marked as what it is; every message is exported all the same.
Tool calls go with the reply that made them, and a tool's result (role ``tool``) says which
tool, which call and its arguments; where the model read a cut result, the whole one follows.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvchat import __version__
from kvchat.store import Message, Session, Store
from kvchat.store.documents_sql import SessionDocument
from kvchat.store.summaries_sql import Summary
from kvchat.store.tools_sql import StoredCall, ToolRecord

ExportFormat = Literal["md", "json", "html"]
FORMATS: tuple[ExportFormat, ...] = ("md", "json", "html")
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool result"}


@dataclass(frozen=True)
class ToolParts:
    """A session's tool calls (by the reply that made them) and its tool messages' records."""

    calls: Mapping[int, Sequence[StoredCall]] = field(default_factory=dict)
    records: Mapping[int, ToolRecord] = field(default_factory=dict)


NO_TOOLS = ToolParts()


def _tool_about(record: ToolRecord) -> str:
    """A tool message's tool, call and outcome, on one line (plain text)."""
    about = [f"{record.name}({record.arguments})", f"call {record.call_id}"]
    if record.is_error:
        about.append("the tool reported an error")
    if record.truncated:
        about.append(f"the model read a cut result; whole: {len(record.full_text):,} characters")
    return " · ".join(about)


def _calls_line(calls: Sequence[StoredCall]) -> str:
    return "; ".join(f"{c.name}({c.arguments}) [{c.call_id}]" for c in calls)


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


def _where(used: SessionDocument, numbers: dict[int, int]) -> str:
    """Where a document entered the conversation, in words."""
    if used.message_id is None:
        return "given at the start"
    number = numbers.get(used.message_id)
    return f"with message {number}" if number is not None else "with a message not exported"


def _about(used: SessionDocument, numbers: dict[int, int]) -> str:
    """A document's kind, size, pages, sha256 and where it came in, on one line."""
    doc = used.document
    pages = f" · {doc.pages:,} pages" if doc.pages is not None else ""
    return f"{doc.kind} · {doc.size:,} bytes{pages} · sha256 {doc.sha256} · {_where(used, numbers)}"


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>#|~!])")
_BACKTICKS = re.compile(r"`+")


def _markdown_name(name: str) -> str:
    """A document's name as literal Markdown text (its markup characters escaped)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(name.split()))


def fenced(text: str) -> str:
    """``text`` verbatim in a code fence longer than any run of backticks in it, so nothing
    in it can close the fence."""
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _numbers(messages: Sequence[Message]) -> dict[int, int]:
    """Message id → its 1-based number in the transcript."""
    return {m.id: n for n, m in enumerate(messages, 1)}


def _later(documents: Sequence[SessionDocument]) -> dict[int, list[str]]:
    """Message id → the names of the documents that came with it."""
    out: dict[int, list[str]] = {}
    for used in documents:
        if used.message_id is not None:
            out.setdefault(used.message_id, []).append(used.document.name)
    return out


def _after(messages: Sequence[Message], summaries: Sequence[Summary]) -> dict[int, list[Summary]]:
    """Message id → the summaries placed after it: each after the last exported message it
    stands for."""
    out: dict[int, list[Summary]] = {}
    for summary in summaries:
        covered = [m.id for m in messages if m.id <= summary.upto_message_id]
        if covered:
            out.setdefault(covered[-1], []).append(summary)
    return out


def _summary_about(summary: Summary, numbers: dict[int, int], messages: Sequence[Message]) -> str:
    """Which messages a summary stands for, in words."""
    last = max((numbers[m.id] for m in messages if m.id <= summary.upto_message_id), default=0)
    return (
        f"Compaction summary: the model reads this instead of messages 1-{last} "
        f"({summary.replaced_tokens:,} tokens) · {summary.created}"
    )


def to_markdown(
    session: Session,
    messages: list[Message],
    reasoning: bool = True,
    documents: Sequence[SessionDocument] = (),
    summaries: Sequence[Summary] = (),
    tools: ToolParts = NO_TOOLS,
) -> str:
    """The transcript; a reply's reasoning (``reasoning``: kept) is a quoted section headed
    "Reasoning" before its answer. ``documents`` come first, under "Documents", each with its
    text in a fence; a message they came with names them."""
    title = " ".join(session.title.split())
    lines = [f"# {title}", "", f"_Session `{session.id}` · created {session.created}_", ""]
    numbers = _numbers(messages)
    if documents:
        lines += ["## Documents", ""]
        for used in documents:
            lines += [f"### {_markdown_name(used.document.name)}", ""]
            lines += [f"_{_about(used, numbers)}_", "", fenced(used.document.text), ""]
    later = _later(documents)
    placed = _after(messages, summaries)
    if session.system_prompt:
        lines += ["## System", "", markdown_block(session.system_prompt), ""]
    for m in messages:
        flag = f" _({_flag(m)})_" if _flag(m) else ""
        lines += [f"## {ROLE_NAMES.get(m.role, m.role)}{flag}", ""]
        if m.id in later:
            names = ", ".join(_markdown_name(name) for name in later[m.id])
            lines += [f"_Attached: {names} (see Documents)_", ""]
        if reasoning and m.reasoning:
            lines += ["> **Reasoning**", ">", quoted(m.reasoning), ""]
        record = tools.records.get(m.id)
        if m.role == "tool" and record is not None:
            lines += [f"_{_markdown_name(_tool_about(record))}_", "", fenced(m.content), ""]
            if record.truncated:
                lines += ["_The whole result:_", "", fenced(record.full_text), ""]
        else:
            lines += [markdown_block(m.content), ""]
        if m.id in tools.calls:
            lines += [f"_Tool calls: {_markdown_name(_calls_line(tools.calls[m.id]))}_", ""]
        for summary in placed.get(m.id, []):
            lines += ["## Summary", "", f"_{_summary_about(summary, numbers, messages)}_", ""]
            lines += [quoted(summary.text), ""]
    return "\n".join(lines).rstrip() + "\n"


def to_json(
    session: Session,
    messages: list[Message],
    reasoning: bool = True,
    documents: Sequence[SessionDocument] = (),
    summaries: Sequence[Summary] = (),
    tools: ToolParts = NO_TOOLS,
) -> str:
    """OpenAI-style messages (a reply's reasoning as ``reasoning_content``) and kvchat's
    own fields; ``documents`` as a list of their metadata and text, each with ``message``:
    the index in ``messages`` of the one it came with (null: given at the start)."""
    chat: list[dict[str, object]] = []
    if session.system_prompt:
        chat.append({"role": "system", "content": session.system_prompt})
    index = {m.id: len(chat) + n for n, m in enumerate(messages)}
    for m in messages:
        item: dict[str, object] = {"role": m.role, "content": m.content}
        if reasoning and m.reasoning:
            item["reasoning_content"] = m.reasoning
        if m.partial:
            item["partial"] = True
        if m.id in tools.calls:
            item["tool_calls"] = [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in tools.calls[m.id]
            ]
        record = tools.records.get(m.id)
        if m.role == "tool" and record is not None:
            item["tool_call_id"] = record.call_id
            item["name"] = record.name
            item["kvchat_tool"] = {
                "arguments": record.arguments,
                "is_error": record.is_error,
                "truncated": record.truncated,
                "full_text": record.full_text,
                "seconds": record.seconds,
            }
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
        "documents": [
            {
                "name": used.document.name,
                "kind": used.document.kind,
                "size": used.document.size,
                "sha256": used.document.sha256,
                "pages": used.document.pages,
                "message": None if used.message_id is None else index.get(used.message_id),
                "text": used.document.text,
            }
            for used in documents
            if used.message_id is None or used.message_id in index
        ],
        "messages": chat,
        # Each summary after ``after``: the index in ``messages`` of the last one it stands for.
        "summaries": [
            {"after": index[placed[-1].id], **summary.to_json()}
            for summary in summaries
            if (placed := [m for m in messages if m.id <= summary.upto_message_id])
        ],
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
.summary{background:#fff8e1;border:1px dashed #c9a227}
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
.documents details{border:1px solid #ddd;border-radius:.4rem;padding:.3rem .8rem;margin:.4rem 0}
.documents summary{cursor:pointer;font-weight:600}.doc-meta,.attached{color:#555;font-size:.85rem}
.documents pre{white-space:pre-wrap}
.tool{background:#f1f8f1;border:1px solid #cfe3cf}.tool-meta{color:#555;font-size:.85rem}
.tool pre{white-space:pre-wrap}
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


def to_html(
    session: Session,
    messages: list[Message],
    reasoning: bool = True,
    documents: Sequence[SessionDocument] = (),
    summaries: Sequence[Summary] = (),
    tools: ToolParts = NO_TOOLS,
) -> str:
    """One file, no scripts, no external resources; every piece of text is escaped and the
    messages' Markdown rendered (code blocks in monospace; ``dir="auto"`` for any script).
    A reply's reasoning is a collapsed ``<details>`` block before its answer. ``documents``
    come first, each a collapsed block with its text escaped in ``<pre>``."""
    esc = html.escape
    numbers = _numbers(messages)
    later = _later(documents)
    placed = _after(messages, summaries)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(session.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(session.title)}</h1>",
        f"<p><small>Session {esc(session.id)} · created {esc(session.created)}</small></p>",
    ]
    if documents:
        parts.append('<section class="documents"><h2>Documents</h2>')
        for used in documents:
            parts.append(
                f'<details class="document"><summary dir="auto">{esc(used.document.name)}'
                f'</summary><p class="doc-meta">{esc(_about(used, numbers))}</p>'
                f'<pre dir="auto">{esc(used.document.text)}</pre></details>'
            )
        parts.append("</section>")
    if session.system_prompt:
        parts.append(
            '<div class="msg system" dir="auto"><span class="role">System</span>'
            f"{esc(session.system_prompt)}</div>"
        )
    for m in messages:
        flag = f' <span class="partial">({_flag(m)})</span>' if _flag(m) else ""
        role = esc(ROLE_NAMES.get(m.role, m.role))
        body = markdown_html(m.content, typed=m.role == "user")
        record = tools.records.get(m.id)
        if m.role == "tool" and record is not None:
            body = f'<p class="tool-meta">{esc(_tool_about(record))}</p><pre>{esc(m.content)}</pre>'
            if record.truncated:
                body += (
                    '<details class="tool-full"><summary>The whole result</summary>'
                    f"<pre>{esc(record.full_text)}</pre></details>"
                )
        if m.id in tools.calls:
            body += f'<p class="tool-meta">Tool calls: {esc(_calls_line(tools.calls[m.id]))}</p>'
        if m.id in later:
            names = ", ".join(esc(name) for name in later[m.id])
            body = f'<p class="attached" dir="auto">Attached: {names}</p>' + body
        if reasoning and m.reasoning:
            thought = markdown_html(m.reasoning)
            body = (
                f'<details class="reasoning"><summary>Reasoning</summary>{thought}</details>' + body
            )
        parts.append(
            f'<div class="msg {esc(m.role)}" dir="auto"><span class="role">{role}{flag}</span>'
            f'<div class="body">{body}</div></div>'
        )
        for summary in placed.get(m.id, []):
            parts.append(
                f'<div class="msg summary" dir="auto"><span class="role">'
                f"{esc(_summary_about(summary, numbers, messages))}</span>"
                f'<div class="body">{markdown_html(summary.text)}</div></div>'
            )
    parts.append(f"<footer>Exported by kvchat {esc(__version__)}</footer></body></html>")
    return "\n".join(parts) + "\n"


def export_session(
    session: Session,
    messages: list[Message],
    fmt: ExportFormat,
    reasoning: bool = True,
    documents: Sequence[SessionDocument] = (),
    summaries: Sequence[Summary] = (),
    tools: ToolParts = NO_TOOLS,
) -> str:
    """The session in ``fmt`` with its ``documents``, compaction ``summaries`` and tool
    calls and results; ``reasoning`` False leaves thinking models' reasoning out."""
    if fmt == "md":
        return to_markdown(session, messages, reasoning, documents, summaries, tools)
    if fmt == "json":
        return to_json(session, messages, reasoning, documents, summaries, tools)
    return to_html(session, messages, reasoning, documents, summaries, tools)


def tool_parts(store: Store, messages: Sequence[Message]) -> ToolParts:
    """The tool calls and records of ``messages`` (what the exports need of them)."""
    replies = [m.id for m in messages if m.role == "assistant"]
    results = [m.id for m in messages if m.role == "tool"]
    if not results and not replies:
        return NO_TOOLS
    return ToolParts(store.tool_calls(replies), store.tool_records(results))
