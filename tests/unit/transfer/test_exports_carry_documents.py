"""Every export says which documents a conversation has and carries their text: Markdown and
HTML in a "Documents" section at the start and a note at the message a later one came with,
JSON as a ``documents`` list with the index of that message (null: the start)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from kvchat.config import load_settings
from kvchat.service.chat import ChatService, open_service
from kvchat.store.documents_sql import DocumentRow

# A document whose text tries to end its fence, add headings and inject markup.
HOSTILE = "```\n## Assistant\nfake reply\n````\n</pre><script>alert(1)</script> & ~~~"


def row(name: str, text: str, kind: str = "text", pages: int | None = None) -> DocumentRow:
    raw = text.encode()
    sha = hashlib.sha256(raw).hexdigest()
    return DocumentRow(DocumentRow.key(name, sha), name, kind, len(raw), sha, text, pages)


@pytest.fixture
def service(kvhome: Path) -> Iterator[ChatService]:
    with open_service(load_settings(), home=kvhome) as chat:
        yield chat


def session_with_documents(chat: ChatService) -> tuple[str, list[DocumentRow]]:
    """A session given two documents at its start and one with its second question."""
    start = [row("guide.md", "# Guide\nTurn the *red* valve.", "markdown"), row("w.txt", HOSTILE)]
    later = row("specs/p.pdf", "Page one.\n\nPage two.", "pdf", pages=2)
    session = chat.sessions.new_session("Valves", "Be brief.")
    chat.store.put_documents([*start, later])
    chat.store.attach_documents(session.id, [d.id for d in start])
    chat.store.add_message(session.id, "user", "Which valve?")
    chat.store.add_message(session.id, "assistant", "The red one.")
    question = chat.store.add_message(session.id, "user", "And in the PDF?")
    chat.store.attach_documents(session.id, [later.id], message_id=question.id)
    chat.store.add_message(session.id, "assistant", "Page two.")
    return session.id, [*start, later]


def test_json_lists_each_document_with_its_text_and_the_message_it_came_with(service):
    session_id, docs = session_with_documents(service)
    exported = json.loads(service.sessions.export(session_id, "json"))
    listed = exported["documents"]
    assert [(d["name"], d["message"]) for d in listed] == [
        ("guide.md", None),
        ("w.txt", None),
        ("specs/p.pdf", 3),  # messages[0] is the system prompt
    ]
    assert exported["messages"][3] == {"role": "user", "content": "And in the PDF?"}
    for entry, doc in zip(listed, docs):
        assert (entry["kind"], entry["size"], entry["sha256"], entry["pages"], entry["text"]) == (
            doc.kind,
            doc.size,
            doc.sha256,
            doc.pages,
            doc.text,
        )


def test_json_of_a_conversation_without_documents_has_an_empty_list(service):
    session = service.sessions.new_session("Plain")
    service.store.add_message(session.id, "user", "hi")
    assert json.loads(service.sessions.export(session.id, "json"))["documents"] == []


def test_markdown_has_a_documents_section_first_and_each_text_stays_in_its_fence(service):
    session_id, docs = session_with_documents(service)
    text = service.sessions.export(session_id, "md")
    assert text.index("## Documents") < text.index("## System") < text.index("## You")
    tokens = MarkdownIt("commonmark").parse(text)
    fences = [t.content for t in tokens if t.type == "fence"]
    assert fences == [d.text + "\n" for d in docs]  # the hostile text ended no fence
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == [
        "Valves",
        "Documents",
        "guide.md",
        "w.txt",
        "specs/p.pdf",
        "System",
        "You",
        "Assistant",
        "You",
        "Assistant",
    ]
    for doc in docs:
        assert doc.sha256 in text and f"{doc.size:,} bytes" in text
    assert "given at the start" in text and "with message 3" in text
    later_question = text.index("## You", text.index("## Assistant"))
    assert text.index("_Attached: specs/p.pdf (see Documents)_") > later_question


class _Texts(HTMLParser):
    """The text of every element of an HTML page, and the tags opened."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.pre: list[str] = []
        self._in_pre = False

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.tags.append(tag)
        if tag == "pre":
            self._in_pre = True
            self.pre.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre":
            self._in_pre = False

    def handle_data(self, data: str) -> None:
        if self._in_pre:
            self.pre[-1] += data


def test_html_shows_each_document_escaped_in_a_section_before_the_messages(service):
    session_id, docs = session_with_documents(service)
    page = service.sessions.export(session_id, "html")
    parsed = _Texts()
    parsed.feed(page)
    parsed.close()
    assert "script" not in parsed.tags
    assert parsed.pre == [d.text for d in docs]
    assert page.index('<section class="documents">') < page.index('class="msg system"')
    assert page.count('<p class="attached" dir="auto">Attached: specs/p.pdf</p>') == 1
    assert "given at the start" in page and "with message 3" in page
