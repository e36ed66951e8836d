"""Export: readable Markdown, JSON an import could read back, self-contained escaped HTML."""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.config import Settings
from kvchat.service.chat import ChatService

EVIL = "<script>alert('x')</script> & <b>bold</b>"


def make_session(home: Path) -> str:
    service = ChatService(Settings())
    session = service.sessions.new_session(title="Export <me>", system_prompt="Be brief.")
    service.store.add_message(session.id, "user", EVIL)
    service.store.add_message(session.id, "assistant", "```python\nprint('hi')\n```")
    service.store.add_message(session.id, "user", "more?")
    service.store.add_message(session.id, "assistant", "cut sho", partial=True)
    service.close()
    return session.id


def test_markdown_transcript(kvhome: Path, cli):
    session = make_session(kvhome)
    text = cli(kvhome, "export", session).stdout
    assert text.startswith("# Export <me>\n")
    assert "## System\n\nBe brief." in text
    assert "## You\n\n" + EVIL in text
    assert "```python\nprint('hi')\n```" in text
    assert "## Assistant _(partial)_\n\ncut sho" in text


def test_json_has_openai_style_messages_and_metadata(kvhome: Path, cli, tmp_path: Path):
    session = make_session(kvhome)
    out = tmp_path / "s.json"
    result = cli(kvhome, "export", session, "--format", "json", "-o", str(out))
    assert f"wrote {out}" in result.stderr
    doc = json.loads(out.read_text())
    assert doc["session"]["id"] == session and doc["session"]["title"] == "Export <me>"
    assert doc["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": EVIL},
        {"role": "assistant", "content": "```python\nprint('hi')\n```"},
        {"role": "user", "content": "more?"},
        {"role": "assistant", "content": "cut sho", "partial": True},
    ]


def test_html_is_self_contained_and_escapes_everything(kvhome: Path, cli):
    session = make_session(kvhome)
    page = cli(kvhome, "export", session, "--format", "html").stdout
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert('x')&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in page
    assert "<title>Export &lt;me&gt;</title>" in page
    assert "http://" not in page and "https://" not in page
    assert page.count('class="msg ') == 5


def test_html_renders_each_message_markdown_like_the_app(kvhome: Path, cli):
    service = ChatService(Settings())
    session = service.sessions.new_session(title="Markdown")
    service.store.add_message(session.id, "user", "Shopping:\n- eggs\n- milk\n\nfirst\nsecond")
    reply = (
        "Use **sorted**:\n\n```python\nprint(sorted(x, key=len))\n```\n\n"
        "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n"
        "![tracker](http://example.com/t.png) [bad](javascript:alert(1)) <img src=x>"
    )
    service.store.add_message(session.id, "assistant", reply)
    service.close()
    page = cli(kvhome, "export", session.id, "--format", "html").stdout
    assert '<pre><code class="language-python">print(sorted(x, key=len))' in page
    assert "font-family:ui-monospace" in page  # code blocks in monospace
    assert "<strong>sorted</strong>" in page and "<table>" in page
    assert "<li>eggs</li>" in page and "first<br />" in page  # your lines kept
    assert page.count('dir="auto"') == 2
    # Self-contained and safe: no image is loaded, no script link, raw HTML is text.
    assert "<img" not in page and 'href="javascript' not in page
    assert "&lt;img src=x&gt;" in page
