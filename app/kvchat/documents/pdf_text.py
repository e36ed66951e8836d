"""A PDF's text layer, read by pypdf in a child process held to CPU, memory and wall-time
limits.

Measured with pypdf 7.1 in-process: a 12 KB PDF whose one page inflates to a million text
operators took 5 s and 320 MB before pypdf's own per-stream limit stopped it, and such pages
can repeat; a thread cannot be stopped. A child can: RLIMIT_CPU, RLIMIT_AS and a wall
deadline end it, and whatever it did, kvchat gets one line. The bytes go to the child on its
standard input (the very bytes that were hashed), its answer comes back as one JSON object.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

from kvchat.documents.bounds import ReadBounds
from kvchat.documents.document import refuse
from kvchat.units import human_bytes

CHILD_MODULE = "kvchat.documents.pdf_child"
# What the child answers when it refuses a PDF: a code and its words.
REFUSALS = {
    "encrypted": "is an encrypted PDF (kvchat reads no password-protected PDF)",
    "no-text": "is a PDF with no text layer (a scan?)",
    "memory": "is a PDF that needs over {memory} of memory to read",
}


def pdf_text(name: str, raw: bytes, bounds: ReadBounds) -> tuple[str, int]:
    """The text of the PDF ``raw`` (pages joined by form feeds made blank lines) and its page
    count, or a :class:`~kvchat.errors.DocumentError` that says why not."""
    request = json.dumps({"max_pages": bounds.max_pdf_pages, "max_chars": bounds.max_text_chars})

    def limit_child() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (bounds.pdf_cpu_s, bounds.pdf_cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (bounds.pdf_memory_bytes, bounds.pdf_memory_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()  # a Ctrl-C in the terminal is kvchat's to handle, not the child's

    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, request],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=limit_child,
        )
    except OSError as exc:
        raise refuse(name, f"could not start the PDF reader ({exc.strerror or exc})") from None
    try:
        stdout, _ = proc.communicate(raw, timeout=bounds.pdf_wall_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise refuse(
            name, f"is a PDF that took over {bounds.pdf_wall_s:g} s to read (the limit)"
        ) from None
    if proc.returncode == -signal.SIGXCPU:
        raise refuse(name, f"is a PDF that took over {bounds.pdf_cpu_s} s of CPU to read")
    if proc.returncode < 0:
        raise refuse(name, f"is a PDF the reader died on ({_signal_name(-proc.returncode)})")
    answer = _answer(stdout, bounds)
    if isinstance(answer, str):
        words = REFUSALS.get(answer)
        if words is not None:
            raise refuse(name, words.format(memory=human_bytes(bounds.pdf_memory_bytes)))
        raise refuse(name, answer)
    return answer


def _answer(stdout: bytes, bounds: ReadBounds) -> tuple[str, int] | str:
    """The child's answer, checked: (text, pages), or the words of its refusal."""
    try:
        answer = json.loads(stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "is a PDF the reader failed on (no answer)"
    if not isinstance(answer, dict):
        return "is a PDF the reader failed on (no answer)"
    text, pages, error = answer.get("text"), answer.get("pages"), answer.get("error")
    if isinstance(error, str):
        return error[:300]
    if (
        isinstance(text, str)
        and type(pages) is int
        and 0 < pages <= bounds.max_pdf_pages
        and len(text) <= bounds.max_text_chars + pages
    ):
        return text, pages
    return "is a PDF the reader failed on (a malformed answer)"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
