"""``kvchat bench --peers``: kvchat side by side with what a user would pick instead, on one
conversation, in one run, every figure a ratio to re-reading it measured in the same run.

The rows:

* **re-read** — nothing kept: after a restart the whole history is read again (Ollama,
  LM Studio). llama-cpp-python's ``Llama.generate`` on the conversation's tokens.
* **LlamaDiskCache** — llama-cpp-python's own cache of whole states keyed by prompt: the
  calls its ``create_completion`` makes with a cache set (``cache[prompt]`` → ``load_state``
  before, ``cache[prompt + reply] = save_state()`` after), timed one by one. Part of
  llama_cpp; nothing is installed for it.
* **llama-server slots** — a real llama-server (``kvchat server build``): the slot saved
  after each turn and restored on resume (Jan's per-thread saving, stillwarm, hearth-llm).
  Without the binary the row says so.
* **kvchat (disk)** after a restart and **kvchat (RAM)** after a switch.

Each peer runs the same settings (model, n_ctx, threads, KV types, flash attention) and is
given the same token ids. Its restore is verified the way it would be used: the greedy
reply after the restore against a full read by the same peer, token for token (text for
the server and kvchat). What each does with a snapshot of another KV type (q8_0 where the
run is f16) is tried in a child process, so a crash is reported, not suffered.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.bench.progress import LOAD_S, BenchPlan, Reporter, Step, prefill_seconds
from kvchat.bench.report import (
    column_notes,
    machine,
    machine_line,
    seconds_words,
    times_words,
)
from kvchat.bench.runs import NEXT_MESSAGE, _paragraph, build_history
from kvchat.config import Settings
from kvchat.engine import GenerationParams, GenerationStats
from kvchat.service.chat import ChatService, open_service
from kvchat.service.context_window import system_head
from kvchat.text import one_line

RE_READ = "re-read"
DISK_CACHE = "LlamaDiskCache"
SERVER = "llama-server slots"
KVCHAT_DISK = "kvchat (disk)"
KVCHAT_RAM = "kvchat (RAM)"
PEERS = (RE_READ, DISK_CACHE, SERVER, KVCHAT_DISK, KVCHAT_RAM)
HOW = {
    RE_READ: "keeps nothing; reads the whole history again (Ollama, LM Studio)",
    DISK_CACHE: "llama-cpp-python's whole state per prompt, pickled (diskcache)",
    SERVER: "llama-server's whole slot file, rewritten each turn (Jan, stillwarm, hearth-llm)",
    KVCHAT_DISK: "kvchat's chunks on disk, after a restart",
    KVCHAT_RAM: "kvchat's RAM tier, after switching conversations",
}
# Greedy tokens compared after each restore against the same peer's full read.
GREEDY_TOKENS = 16
# The foreign snapshot: this KV type where the run's is another.
FOREIGN_KV = "q8_0"
Chat = list[dict[str, str]]


@dataclass
class PeerRow:
    """One way of keeping a conversation, measured; ``missing`` says why it was not."""

    peer: str
    how: str
    missing: str | None = None
    # Per history length (its tokens, as a string key): time to the first token on resume.
    ttft_ms: dict[str, float] = field(default_factory=dict)
    # re-read ÷ this, per length: how many times sooner the first token comes.
    sooner: dict[str, float] = field(default_factory=dict)
    decoded: dict[str, int] = field(default_factory=dict)
    # The same peer reading the whole prompt itself (its own engine), per length, and ÷ this.
    own_reread_ms: dict[str, float] = field(default_factory=dict)
    sooner_than_own: dict[str, float] = field(default_factory=dict)
    # Greedy after the restore equal to the same peer's full read (None: not verified).
    greedy_equal: bool | None = None
    greedy_note: str = ""
    # Across the turns of one conversation: the save's time, bytes written, the whole turn.
    save_ms_per_turn: float | None = None
    written_per_turn: float | None = None
    written_over_new_kv: float | None = None
    turn_ms: float | None = None
    turn_over_reread: float | None = None
    # Conversations sharing a prefix: bytes on disk, and ÷ the KV itself (prefix once).
    shared_disk_bytes: int | None = None
    shared_over_kv: float | None = None
    # Of those conversations, how many it could still restore at the end.
    shared_kept: int | None = None
    # A snapshot of another KV type: "rejected: …", "accepted: …", "crashed: …".
    foreign: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in data.items()}


@dataclass
class PeersReport:
    rows: list[PeerRow] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    turns: int = 0
    conversations: int = 0
    prefix_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    estimate_s: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeersReport:
        """A report back from its ``--json`` (for tables made later)."""
        known = set(PeerRow.__dataclass_fields__)
        return cls(
            rows=[PeerRow(**{k: v for k, v in r.items() if k in known}) for r in data["rows"]],
            sizes=list(data["sizes"]),
            turns=int(data["turns"]),
            conversations=int(data["conversations"]),
            prefix_tokens=int(data["prefix_tokens"]),
            kv_bytes_per_token=float(data["kv_bytes_per_token"]),
            machine=dict(data["machine"]),
            elapsed_s=float(data["elapsed_s"]),
            estimate_s=float(data["estimate_s"]),
        )

    def row(self, peer: str) -> PeerRow:
        return next(r for r in self.rows if r.peer == peer)

    def to_json(self) -> dict[str, Any]:
        return {
            "headline": peers_headline(self),
            "sizes": self.sizes,
            "turns": self.turns,
            "conversations": self.conversations,
            "prefix_tokens": self.prefix_tokens,
            "kv_bytes_per_token": round(self.kv_bytes_per_token, 1),
            "rows": [r.to_json() for r in self.rows],
            "estimate_s": round(self.estimate_s, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "machine": self.machine,
        }


# --- llama-cpp-python, as a user of it would call it ---------------------------------------


class LlamaPeer:
    """A second llama.cpp context through llama-cpp-python's high-level ``Llama``, on the
    kvchat engine's settings: the re-read and LlamaDiskCache rows."""

    def __init__(self, config: Any) -> None:
        import llama_cpp

        from kvchat.engine.llama import llama_arguments

        self.llm = llama_cpp.Llama(**llama_arguments(config))

    def restart(self) -> None:
        """Nothing in the context, as in a new process (the model stays loaded, as it does
        for every row)."""
        self.llm.reset()

    def read(self, tokens: Sequence[int]) -> None:
        """A previous turn: the tokens into the context."""
        self.restart()
        self.llm.eval(list(tokens))

    def greedy(self, tokens: Sequence[int], n: int = GREEDY_TOKENS) -> tuple[float, list[int]]:
        """(ms to the first token, the first ``n`` greedy tokens), reusing what the context
        holds as ``Llama.generate`` does."""
        started = time.perf_counter()
        ttft = 0.0
        out: list[int] = []
        gen = self.llm.generate(list(tokens), top_k=1, top_p=1.0, temp=0.0, reset=True)
        try:
            for token in gen:
                if not out:
                    ttft = (time.perf_counter() - started) * 1000
                out.append(int(token))
                if len(out) >= n:
                    break
        finally:
            gen.close()
        return ttft, out

    def close(self) -> None:
        self.llm.close()


class DiskCachePeer:
    """llama-cpp-python's ``LlamaDiskCache`` driven by the calls ``create_completion`` makes."""

    def __init__(self, llama: LlamaPeer, directory: Path) -> None:
        from llama_cpp import LlamaDiskCache

        self.llama = llama
        self.directory = directory
        # Room for every state this run saves (LlamaDiskCache's own limit; diskcache's
        # size_limit of 1 GiB still applies: see save).
        self.cache = LlamaDiskCache(cache_dir=str(directory), capacity_bytes=64 << 30)

    def save(self, key: Sequence[int]) -> tuple[float, int]:
        """``cache[key] = save_state()``: (ms, bytes of the files it wrote). Not the
        directory's growth: diskcache drops the oldest entries past its own 1 GiB
        ``size_limit`` (LlamaDiskCache leaves it at the default), whatever capacity_bytes
        says."""
        before = dir_files(self.directory)
        started = time.perf_counter()
        with _quiet():  # LlamaDiskCache.__setitem__ prints to stderr
            self.cache[list(key)] = self.llama.llm.save_state()
        ms = (time.perf_counter() - started) * 1000
        after = dir_files(self.directory)
        return ms, sum(size for path, size in after.items() if before.get(path) != size)

    def holds(self, key: Sequence[int]) -> bool:
        """Whether the entry saved under ``key`` is still in the cache."""
        return tuple(key) in self.cache.cache

    def put(self, key: Sequence[int], state: Any) -> None:
        with _quiet():
            self.cache[list(key)] = state

    def resume(self, tokens: Sequence[int]) -> tuple[float, list[int], Any]:
        """After a restart: the longest cached prefix loaded (and popped, as the cache does),
        then the rest decoded; (ms to the first token, greedy tokens, the loaded state)."""
        self.llama.restart()
        started = time.perf_counter()
        state = self.cache[list(tokens)]
        self.llama.llm.load_state(state)
        loaded_ms = (time.perf_counter() - started) * 1000
        ttft, out = self.llama.greedy(tokens)
        return loaded_ms + ttft, out, state


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def dir_files(path: Path) -> dict[str, int]:
    """Size of each regular file under ``path``."""
    found: dict[str, int] = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with contextlib.suppress(OSError):
                found[full] = os.lstat(full).st_size
    return found


# --- a real llama-server -------------------------------------------------------------------


class PeerServerError(Exception):
    """The server could not be used: one line."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerPeer:
    """A llama-server with one slot and a slot directory in the bench's scratch space,
    started with the settings every row uses."""

    def __init__(self, settings: Settings, slot_dir: Path, threads: int) -> None:
        from kvchat.engine.server_build import find_binary, plan_server

        binary = find_binary()
        if binary is None:
            raise PeerServerError(
                "not measured: no llama-server is built here (kvchat server build)"
            )
        slot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.slot_dir = slot_dir
        self.timeout = 600.0
        plan = plan_server(settings, port=free_port(), slots=1, slot_dir=slot_dir)
        self.host, self.port = "127.0.0.1", plan.port
        argv = [*plan.argv(), "--threads", str(threads), "--threads-batch", str(threads)]
        self.log = slot_dir.parent / f"llama-server-{plan.port}.log"
        try:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
        except OSError as exc:
            raise PeerServerError(
                f"not measured: could not start {binary}: {exc.strerror or exc}"
            ) from None
        self._wait_ready(120.0)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerServerError(f"llama-server exited ({self.proc.returncode}) at start")
            try:
                status, _ = self._request("GET", "/health", None, 2.0)
                if status == 200:
                    return
            except PeerServerError:
                pass
            time.sleep(0.2)
        raise PeerServerError(f"llama-server was not ready in {timeout:.0f} s")

    def _request(
        self, method: str, path: str, body: Any, timeout: float | None = None
    ) -> tuple[int, Any]:
        """(HTTP status, the JSON body or None); :class:`PeerServerError` when the server
        cannot be reached or its reply is not HTTP. At most 1 MiB of a body is read."""
        import http.client

        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, payload, headers)
            response = conn.getresponse()
            raw = response.read(1 << 20)
        except (OSError, http.client.HTTPException) as exc:
            raise PeerServerError(f"{path}: {_one_line(exc)}") from None
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            data = None
        return response.status, data

    def slot(self, action: str, filename: str | None = None) -> tuple[int, Any]:
        body = {"filename": filename} if filename else {}
        return self._request("POST", f"/slots/0?action={action}", body)

    def completion(self, tokens: Sequence[int], n: int) -> tuple[float, str, int]:
        """(ms to the first token, the greedy text, tokens the server evaluated for the
        prompt) with the slot's cached prompt reused."""
        import http.client

        body = {
            "prompt": list(tokens),
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "id_slot": 0,
            "stream": True,
        }
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        started = time.perf_counter()
        ttft = 0.0
        text: list[str] = []
        evaluated = -1
        events = 0
        stopped = False
        try:
            conn.request(
                "POST", "/completion", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            if response.status != 200:
                raise PeerServerError(f"completion: HTTP {response.status}")
            while True:
                line = response.readline(1 << 20)
                if not line:
                    break
                if len(line) >= 1 << 20 and not line.endswith(b"\n"):
                    raise PeerServerError("completion: a line of over 1 MiB")
                if not line.startswith(b"data: "):
                    continue
                try:
                    event = json.loads(line[6:])
                except (ValueError, RecursionError):
                    raise PeerServerError("completion: a reply that is not JSON") from None
                events += 1
                if events > n + 64:
                    raise PeerServerError("completion: more events than tokens asked for")
                if not isinstance(event, dict):
                    continue
                content = event.get("content")
                if isinstance(content, str) and content and not ttft:
                    ttft = (time.perf_counter() - started) * 1000
                if isinstance(content, str):
                    text.append(content)
                if event.get("stop"):
                    timings = event.get("timings")
                    if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
                        evaluated = int(timings["prompt_n"])
                    stopped = True
                    break
        except (OSError, http.client.HTTPException) as exc:
            raise PeerServerError(f"completion: {_one_line(exc)}") from None
        finally:
            conn.close()
        if not stopped:
            raise PeerServerError("completion: the reply ended before its last event")
        return ttft, "".join(text), evaluated

    def save(self, name: str) -> tuple[float, int]:
        """The slot saved as ``name``: (ms, bytes written)."""
        started = time.perf_counter()
        status, data = self.slot("save", name)
        ms = (time.perf_counter() - started) * 1000
        if status != 200:
            raise PeerServerError(f"slot save: HTTP {status}")
        written = data.get("n_written") if isinstance(data, dict) else None
        if isinstance(written, int) and not isinstance(written, bool) and 0 <= written < 1 << 40:
            return ms, written
        try:  # no figure in the reply: the file's size, as the slot directory holds it
            return ms, (self.slot_dir / name).stat().st_size
        except OSError:
            raise PeerServerError("slot save: no size in the reply and no file written") from None

    def restore(self, name: str) -> None:
        status, data = self.slot("restore", name)
        if status != 200:
            raise PeerServerError(f"slot restore: HTTP {status}: {_error_line(data)}")

    def erase(self) -> None:
        self.slot("erase")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _one_line(exc: BaseException) -> str:
    return one_line(str(exc))[:200] or type(exc).__name__


def _error_line(data: Any) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str):
            return one_line(error)[:200] or "no message"
    return "no message"


# --- kvchat, through the service as a turn uses it -----------------------------------------


def _chat(service: ChatService, session_id: str) -> Chat:
    """The session's prompt messages: the system head and every message."""
    session = service.store.get_session(session_id)
    head = system_head(session.system_prompt or service.host.settings.system_prompt)
    return head + [m.as_chat() for m in service.sessions.messages(session_id)]


def _kvchat_turn(
    service: ChatService, session_id: str, chat: Chat, tier: str | None
) -> tuple[float, str, int]:
    """The next message's greedy reply with the session restored from ``tier`` ("disk",
    "ram") or read again (None): (ms to the first token, restore included; the reply;
    tokens decoded)."""
    tiers = service.host.tiers
    engine = service.load_engine()
    tiers.mark_hot(None)
    if tier == "disk":
        tiers.warm.clear()
    stats = GenerationStats()  # the clock starts here, as a turn's does
    if tier is None:
        engine.clear()
    else:
        restored = service.make_hot(session_id)
        if restored.source != tier:
            raise RuntimeError(f"bench: kvchat's {tier} restore failed: {restored.reason}")
    prompt = engine.chat_tokens(chat + [{"role": "user", "content": NEXT_MESSAGE}])
    prefill = engine.prefill(prompt)
    params = GenerationParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    reply = "".join(engine.generate(params, stats))
    tiers.mark_hot(None)  # the context holds the probe now, not the session
    return stats.ttft_ms or 0.0, reply, prefill.decoded


def _verdict(row: PeerRow, size: str, equal: bool) -> None:
    """Fold one size's greedy comparison into the row."""
    row.greedy_equal = equal if row.greedy_equal is None else (row.greedy_equal and equal)
    if not equal:
        row.greedy_note = (row.greedy_note + f" differs at {size} tokens;").strip()


# --- the run -------------------------------------------------------------------------------


@dataclass
class _Peers:
    """Everything one run drives, and its rows."""

    service: ChatService
    llama: LlamaPeer
    disk: DiskCachePeer
    server: ServerPeer | None
    rows: dict[str, PeerRow]
    say: Callable[[str], None]
    repeat: int
    first_session: str = ""


def _resume(p: _Peers, target: int) -> None:
    """One history length, after a restart: every row's first token and greedy reply."""
    service, rows, say = p.service, p.rows, p.say
    engine = service.load_engine()
    session_id = build_history(service, target)
    say(f"{target}: kvchat reads the history and saves it…")
    service.regenerate(session_id, max_tokens=1, temperature=0.0, no_restore=True)
    p.first_session = p.first_session or session_id
    chat = _chat(service, session_id)
    history = engine.chat_tokens(chat)
    prompt = engine.chat_tokens(chat + [{"role": "user", "content": NEXT_MESSAGE}])
    size = str(len(history))

    say(f"{target}: re-read (llama-cpp-python, nothing kept)…")
    p.llama.restart()
    reread_ms, reference = p.llama.greedy(prompt)
    row = rows[RE_READ]
    row.ttft_ms[size], row.sooner[size], row.decoded[size] = reread_ms, 1.0, len(prompt)
    _own(row, size, reread_ms)
    row.greedy_equal, row.greedy_note = True, "the reference: a full read"

    say(f"{target}: LlamaDiskCache…")
    p.llama.read(history)  # the previous turn
    p.disk.save(history)
    times, state = [], None
    for _ in range(p.repeat):
        if state is not None:
            p.disk.put(history, state)  # the cache pops what it loads
        ms, tokens, state = p.disk.resume(prompt)
        times.append(ms)
        _verdict(rows[DISK_CACHE], size, tokens == reference)
    held = int(state.n_tokens) if state is not None else 0
    _timed(rows[DISK_CACHE], size, times, reread_ms, len(prompt) - _common(history[:held], prompt))
    _own(rows[DISK_CACHE], size, reread_ms)

    say(f"{target}: kvchat, from disk after a restart and from RAM after a switch…")
    own_ms, kv_reference, _ = _kvchat_turn(service, session_id, chat, None)
    for peer, tier in ((KVCHAT_DISK, "disk"), (KVCHAT_RAM, "ram")):
        if tier == "ram":
            service.make_hot(session_id)
            service.host.tiers.spill()  # into the RAM tier, as a switch leaves it
        times, decoded = [], 0
        for _ in range(p.repeat):
            ms, reply, decoded = _kvchat_turn(service, session_id, chat, tier)
            times.append(ms)
            _verdict(rows[peer], size, reply == kv_reference)
        _timed(rows[peer], size, times, reread_ms, decoded)
        _own(rows[peer], size, own_ms)
    service.host.tiers.warm.clear()

    if p.server is not None:
        say(f"{target}: llama-server, its slot saved and restored…")
        with _server_part(p):
            _server_resume(p, target, history, prompt, size, reread_ms)


def _server_resume(
    p: _Peers, target: int, history: list[int], prompt: list[int], size: str, reread_ms: float
) -> None:
    server, row = p.server, p.rows[SERVER]
    assert server is not None
    name = f"conversation-{target}.bin"
    server.erase()
    server.completion(history, 1)  # the previous turn
    server.save(name)
    server.erase()
    own_ms, reference, _ = server.completion(prompt, GREEDY_TOKENS)  # its own full read
    times, evaluated = [], 0
    for _ in range(p.repeat):
        server.erase()  # a restart: nothing in the slot
        started = time.perf_counter()
        server.restore(name)
        restored_ms = (time.perf_counter() - started) * 1000
        ttft, text, evaluated = server.completion(prompt, GREEDY_TOKENS)
        times.append(restored_ms + ttft)
        _verdict(row, size, text == reference)
    _timed(row, size, times, reread_ms, evaluated)
    _own(row, size, own_ms)


def _timed(row: PeerRow, size: str, times: list[float], reread_ms: float, decoded: int) -> None:
    ms = statistics.median(times)
    row.ttft_ms[size] = ms
    row.sooner[size] = reread_ms / ms if ms else 0.0
    row.decoded[size] = decoded


def _own(row: PeerRow, size: str, own_ms: float) -> None:
    """The peer's own full read of the same prompt, and how many times sooner its resume."""
    row.own_reread_ms[size] = own_ms
    ms = row.ttft_ms.get(size, 0.0)
    row.sooner_than_own[size] = own_ms / ms if ms else 0.0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _turns(p: _Peers, turns: int, per_token: float) -> None:
    """One conversation of ``turns`` turns per row (the same user messages, greedy replies
    of 16 tokens): the save after each turn, its bytes, and the whole turn."""
    rng = random.Random(20)
    messages = [_paragraph(rng, 60) for _ in range(turns)]
    engine = p.service.load_engine()
    rows = p.rows

    p.say(f"turns: {turns} turns, llama-cpp-python and LlamaDiskCache…")
    chat: Chat = []
    compute, saves, written = [], [], []
    p.llama.restart()
    tokens: list[int] = []
    for text in messages:
        chat.append({"role": "user", "content": text})
        tokens = engine.chat_tokens(chat)
        started = time.perf_counter()
        _, reply = p.llama.greedy(tokens)
        compute.append((time.perf_counter() - started) * 1000)
        ms, grew = p.disk.save(tokens + reply)
        saves.append(ms)
        written.append(grew)
        chat.append(
            {
                "role": "assistant",
                "content": p.llama.llm.detokenize(reply).decode("utf-8", errors="replace"),
            }
        )
    new_kv = per_token * len(tokens) / turns
    reread_turn = statistics.mean(compute)
    _turn_row(rows[RE_READ], 0.0, 0.0, reread_turn, reread_turn, new_kv)
    _turn_row(
        rows[DISK_CACHE],
        statistics.mean(saves),
        statistics.mean(written),
        reread_turn + statistics.mean(saves),
        reread_turn,
        new_kv,
    )

    p.say(f"turns: {turns} turns, kvchat…")
    session = p.service.sessions.new_session(title="bench peers turns")
    times, saves, written = [], [], []
    for text in messages:
        started = time.perf_counter()
        report = p.service.send(session.id, text, max_tokens=GREEDY_TOKENS, temperature=0.0)
        times.append((time.perf_counter() - started) * 1000)
        saves.append(report.snapshot.ms)
        written.append(report.snapshot.written)
    kv_new = per_token * p.service.context_tokens / turns
    for peer in (KVCHAT_DISK, KVCHAT_RAM):
        _turn_row(
            rows[peer],
            statistics.mean(saves),
            statistics.mean(written),
            statistics.mean(times),
            reread_turn,
            kv_new,
        )

    with _server_part(p):
        _server_turns(p, messages, engine, turns, per_token, reread_turn)


def _server_turns(
    p: _Peers, messages: list[str], engine: Any, turns: int, per_token: float, reread: float
) -> None:
    rows = p.rows
    reread_turn = reread
    if p.server is not None:
        p.say(f"turns: {turns} turns, llama-server…")
        server = p.server
        server.erase()
        chat, times, saves, written = [], [], [], []
        for text in messages:
            chat.append({"role": "user", "content": text})
            tokens = engine.chat_tokens(chat)
            started = time.perf_counter()
            _, reply_text, _ = server.completion(tokens, GREEDY_TOKENS)
            ms, grew = server.save("turns.bin")  # one file per conversation, rewritten
            times.append((time.perf_counter() - started) * 1000)
            saves.append(ms)
            written.append(grew)
            chat.append({"role": "assistant", "content": reply_text})
        _turn_row(
            rows[SERVER],
            statistics.mean(saves),
            statistics.mean(written),
            statistics.mean(times),
            reread_turn,
            per_token * len(tokens) / turns,
        )


def _turn_row(
    row: PeerRow, save_ms: float, written: float, turn_ms: float, reread: float, new_kv: float
) -> None:
    row.save_ms_per_turn = save_ms
    row.written_per_turn = written
    row.written_over_new_kv = written / new_kv if new_kv else None
    row.turn_ms = turn_ms
    row.turn_over_reread = turn_ms / reread if reread else None


def _shared(p: _Peers, conversations: int, prefix: int, per_token: float) -> int:
    """``conversations`` conversations continuing one ~``prefix``-token history (forks in
    kvchat; the parent's state loaded, then the branch, in the others): bytes on disk for
    them. Returns the prefix's tokens."""
    service, rows, say = p.service, p.rows, p.say
    engine = service.load_engine()
    say(f"shared prefix: {conversations} conversations on one {prefix:,}-token history…")
    kv = service.host.kv()
    before = kv.stats()["disk"]["bytes"]
    parent = build_history(service, prefix, seed=3)
    service.regenerate(parent, max_tokens=1, temperature=0.0, no_restore=True)
    chat = _chat(service, parent)
    history = engine.chat_tokens(chat)
    branch_tokens = 0
    children: list[str] = []
    for index in range(conversations):
        child = service.sessions.fork(parent)
        children.append(child.id)
        service.send(
            child.id, f"Conversation {index}: {NEXT_MESSAGE}", max_tokens=8, temperature=0.0
        )
        branch_tokens += service.context_tokens - len(history)
    ideal = per_token * (len(history) + branch_tokens)
    on_disk = kv.stats()["disk"]["bytes"] - before
    kept = sum(1 for child in children if service.host.tiers.snapshot(child) is not None)
    for peer in (KVCHAT_DISK, KVCHAT_RAM):
        rows[peer].shared_disk_bytes = on_disk
        rows[peer].shared_over_kv = on_disk / ideal
        rows[peer].shared_kept = kept
    rows[RE_READ].shared_disk_bytes, rows[RE_READ].shared_over_kv = 0, 0.0
    rows[RE_READ].shared_kept = 0

    say("shared prefix: LlamaDiskCache…")
    branches = [
        engine.chat_tokens(
            chat + [{"role": "user", "content": f"Conversation {i}: {NEXT_MESSAGE}"}]
        )
        for i in range(conversations)
    ]
    p.llama.read(history)
    parent_state = p.llama.llm.save_state()
    total = 0
    keys = []
    for tokens in branches:
        p.llama.restart()
        p.llama.llm.load_state(parent_state)
        _, reply = p.llama.greedy(tokens, 8)
        keys.append(tokens + reply)
        total += p.disk.save(keys[-1])[1]
    rows[DISK_CACHE].shared_disk_bytes = total
    rows[DISK_CACHE].shared_over_kv = total / ideal
    rows[DISK_CACHE].shared_kept = sum(1 for key in keys if p.disk.holds(key))

    with _server_part(p):
        _server_shared(p, history, branches, ideal)
    return len(history)


def _server_shared(p: _Peers, history: list[int], branches: list[list[int]], ideal: float) -> None:
    rows = p.rows
    if p.server is not None:
        p.say("shared prefix: llama-server…")
        server = p.server
        server.erase()
        server.completion(history, 1)
        server.save("parent.bin")
        total = 0
        for index, tokens in enumerate(branches):
            server.restore("parent.bin")
            server.completion(tokens, 8)
            total += server.save(f"shared-{index}.bin")[1]
        rows[SERVER].shared_disk_bytes = total
        rows[SERVER].shared_over_kv = total / ideal
        rows[SERVER].shared_kept = sum(
            1
            for index in range(len(branches))
            if (server.slot_dir / f"shared-{index}.bin").is_file()
        )


@contextlib.contextmanager
def _server_part(p: _Peers) -> Iterator[None]:
    """A part of the llama-server row: when the server fails (unreachable, a reply that is
    not what llama-server sends, an HTTP error), its row stops with that one line and the
    server is closed; the other rows go on."""
    try:
        yield
    except PeerServerError as exc:
        if p.server is not None:
            p.server.close()
            p.server = None
        p.rows[SERVER].missing = f"stopped: {exc}"
        p.say(f"llama-server: stopped: {exc}")


def _foreign_kvchat(settings: Settings, home: Path, session_id: str, kv: str) -> str:
    """kvchat opened with another KV type on the same home, resuming the same session."""
    changed = settings.model_copy(update={"type_k": kv, "type_v": kv, "flash_attn": True})
    with open_service(changed, home=home) as service:
        probe = service.turns.probe(session_id, NEXT_MESSAGE)
    if probe.restore.source in ("disk", "ram"):
        return f"accepted ({probe.restore.source})"
    reason = probe.restore.reason or "not restored"
    return f"rejected: {reason}; read again ({probe.tokens.decoded:,} tokens)"


def _foreign_disk_cache(directory: Path, config: Any, kv: str) -> str:
    """LlamaDiskCache's saved state loaded into a context of another KV type (a child)."""
    argv = [
        sys.executable,
        "-m",
        "kvchat.bench.peer_child",
        str(directory),
        str(config.model_path),
        str(config.n_ctx),
        str(config.n_threads),
        kv,
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "hung: no answer in 300 s"
    if proc.returncode < 0:
        return f"crashed: signal {-proc.returncode} ({_signal_name(-proc.returncode)})"
    try:
        last = proc.stdout.strip().splitlines()[-1]
        data = json.loads(last)
        return f"{one_line(str(data['outcome']))[:20]}: {one_line(str(data['why']))[:160]}"
    except (IndexError, ValueError, KeyError, TypeError):
        tail = one_line(proc.stderr)[-160:]
        return f"crashed: exit {proc.returncode}: {tail}"


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def _foreign_server(settings: Settings, slot_dir: Path, threads: int, kv: str) -> str:
    """A llama-server of another KV type restoring the first server's slot file."""
    files = sorted(slot_dir.glob("conversation-*.bin"))
    if not files:
        return "not measured: no slot file was saved"
    changed = settings.model_copy(update={"type_k": kv, "type_v": kv, "flash_attn": True})
    try:
        server = ServerPeer(changed, slot_dir, threads)
    except PeerServerError as exc:
        return f"not measured: {exc}"
    try:
        status, data = server.slot("restore", files[0].name)
        if server.proc.poll() is not None:
            return f"crashed: llama-server exited ({server.proc.returncode})"
        if status != 200:
            return f"rejected: HTTP {status}: {_error_line(data)}"
        return "accepted: the slot restored"
    except OSError as exc:
        if server.proc.poll() is not None:
            return f"crashed: llama-server exited ({server.proc.returncode})"
        return f"rejected: {exc}"
    finally:
        server.close()


def plan_peers(
    sizes: list[int],
    rate: float,
    *,
    repeat: int,
    turns: int,
    conversations: int,
    prefix: int,
    server: bool,
) -> BenchPlan:
    """Per size: the history read by kvchat twice, llama-cpp-python twice, the server twice;
    the turns (three conversations); the shared prefix (three reads of it); the foreign
    snapshots (two model loads, a server start)."""
    reads = 6 if server else 4
    steps = []
    for size in sizes:
        seconds = reads * prefill_seconds(size, rate) + repeat * 4 * 0.6 + 2
        steps.append(Step(f"resume-{size}", f"{size:,} tokens: every row resumes", seconds))
    per_turn = prefill_seconds(130, rate) + GREEDY_TOKENS / 50 + 0.3
    steps.append(Step("turns", f"{turns} turns per row", (3 if server else 2) * turns * per_turn))
    shared = (3 if server else 2) * prefill_seconds(prefix, rate) + conversations * 1.5
    steps.append(Step("shared", f"{conversations} conversations on one prefix", shared))
    steps.append(
        Step("foreign", "a snapshot of another KV type", 2 * LOAD_S + (4 if server else 0))
    )
    return BenchPlan(tuple(steps))


def run_peers(
    settings: Settings,
    sizes: list[int],
    *,
    repeat: int = 3,
    turns: int = 20,
    conversations: int = 10,
    prefix: int = 2000,
    reporter: Reporter | None = None,
) -> PeersReport:
    """Every row on the same conversations, in one run (see the module's docstring)."""
    out = reporter or Reporter()
    report = PeersReport(turns=turns, conversations=conversations)
    started = time.monotonic()
    rows = {peer: PeerRow(peer, HOW[peer]) for peer in PEERS}
    rows[RE_READ].foreign = "nothing kept: nothing to load"
    with tempfile.TemporaryDirectory(prefix="kvchat-peers-") as scratch_name:
        scratch = Path(scratch_name)
        home = scratch / "home"
        foreign = "f16" if settings.type_k == FOREIGN_KV else FOREIGN_KV
        with open_service(settings, home=home) as service:
            engine = service.load_engine()
            config = engine.config
            report.machine = machine(engine)
            out.say(machine_line(report.machine))
            fitting = [t for t in sizes if t + 200 <= engine.n_ctx]
            for target in sorted(set(sizes) - set(fitting)):
                out.say(f"skipping {target:,} tokens: does not fit n_ctx={engine.n_ctx:,}")
            speeds = engine.measure_threads([config.n_threads], prompt=128, generate=8)
            rate = float(speeds.get(str(config.n_threads), {}).get("prefill") or 0) or 300.0
            llama = LlamaPeer(config)
            server: ServerPeer | None = None
            try:
                server = ServerPeer(settings, scratch / "slots", config.n_threads)
            except PeerServerError as exc:
                rows[SERVER].missing = str(exc)
            plan = plan_peers(
                fitting,
                rate,
                repeat=repeat,
                turns=turns,
                conversations=conversations,
                prefix=prefix,
                server=server is not None,
            )
            report.estimate_s = plan.seconds + time.monotonic() - started
            out.begin(plan, rate)
            peers = _Peers(
                service,
                llama,
                DiskCachePeer(llama, scratch / "diskcache"),
                server,
                rows,
                out.say,
                repeat,
            )
            try:
                for target in fitting:
                    out.step(f"resume-{target}")
                    _resume(peers, target)
                per_token = _per_token(service)
                report.kv_bytes_per_token = per_token
                out.step("turns")
                _turns(peers, turns, per_token)
                out.step("shared")
                report.prefix_tokens = _shared(peers, conversations, prefix, per_token)
            finally:
                llama.close()
                if server is not None:
                    server.close()
        out.step("foreign")
        out.say(f"a snapshot of another KV type ({foreign})…")
        if peers.first_session:
            rows[KVCHAT_DISK].foreign = _foreign_kvchat(
                settings, home, peers.first_session, foreign
            )
            rows[KVCHAT_RAM].foreign = "RAM holds only this process's own KV"
        rows[DISK_CACHE].foreign = _foreign_disk_cache(scratch / "diskcache", config, foreign)
        if server is not None and rows[SERVER].missing is None:
            rows[SERVER].foreign = _foreign_server(
                settings, scratch / "slots", config.n_threads, foreign
            )
        else:
            rows[SERVER].foreign = "not measured"
    out.finish()
    report.sizes = [int(s) for s in rows[RE_READ].ttft_ms]
    report.rows = [rows[peer] for peer in PEERS]
    report.elapsed_s = time.monotonic() - started
    report.machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _per_token(service: ChatService) -> float:
    """KV bytes per token, from kvchat's snapshots in this run."""
    rows = service.store.snapshots()
    sized = [r for r in rows if r.n_tokens]
    if not sized:
        return 0.0
    return max(r.n_bytes / r.n_tokens for r in sized)


# --- the report ----------------------------------------------------------------------------

PEER_COLUMNS: tuple[tuple[str, str], ...] = (
    (
        "first word",
        "time to the first token of the next message after a restart (a switch, for RAM), "
        "per history length: load what was kept, read the rest",
    ),
    ("sooner", "re-read's first word ÷ this row's, per length, same run"),
    ("own read", "the same peer reading the whole prompt itself, per length"),
    ("÷own", "its own read ÷ its resume: the speedup on its own engine"),
    (
        "greedy",
        "the greedy reply after the restore equals the same peer's full read (every length)",
    ),
    ("save/turn", "time the save after each turn took (mean over the conversation)"),
    (
        "written",
        "bytes written per turn ÷ the KV of the turn's new tokens (1.0× writes nothing "
        "twice; re-read writes nothing and pays a full read instead)",
    ),
    ("turn", "a whole turn (read the message, reply, save) ÷ re-read's turn"),
    (
        "shared",
        "bytes written for the conversations sharing one prefix ÷ the KV itself (the prefix "
        "once + the branches), and how many of them it still holds at the end",
    ),
)


def _cell(sizes: list[str], values: dict[str, float], fmt: Callable[[float], str]) -> str:
    return " / ".join(fmt(values[s]) if s in values else "—" for s in sizes)


def _versus(kv_ms: float, other: PeerRow, size: str) -> str:
    """kvchat against another row, in words."""
    ms = other.ttft_ms[size]
    if not kv_ms or not ms:
        return ""
    ratio = ms / kv_ms
    if ratio >= 1.1:
        return f"{times_words(ratio)} sooner than {other.peer} ({seconds_words(ms)})"
    if ratio > 1 / 1.1:
        return f"level with {other.peer} ({seconds_words(ms)})"
    return f"{other.peer} is {times_words(1 / ratio)} sooner ({seconds_words(ms)})"


def peers_headline(report: PeersReport) -> list[str]:
    """The longest resume, every row, in words."""
    if not report.rows or not report.sizes:
        return []
    size = str(max(report.sizes))
    parts = []
    for row in report.rows:
        if row.missing or size not in row.ttft_ms:
            continue
        parts.append(f"{row.peer} {seconds_words(row.ttft_ms[size])}")
    lines = [
        f"resuming a {int(size):,}-token conversation after a restart, first word: "
        + ", ".join(parts)
    ]
    kv = report.row(KVCHAT_DISK)
    if size in kv.ttft_ms:
        line = f"kvchat from disk: first word in {seconds_words(kv.ttft_ms[size])}"
        own = kv.own_reread_ms.get(size)
        if own:
            line += (
                f" instead of {seconds_words(own)} reading it again "
                f"({times_words(kv.sooner_than_own[size])} sooner)"
            )
        versus = [
            _versus(kv.ttft_ms[size], r, size)
            for r in report.rows
            if r.peer in (DISK_CACHE, SERVER) and size in r.ttft_ms
        ]
        lines.append("; ".join([line, *[v for v in versus if v]]))
    disk, server = report.row(DISK_CACHE), report.row(SERVER)
    if kv.written_per_turn is not None and disk.written_per_turn:
        line = (
            f"per turn kvchat wrote {kv.written_per_turn / 2**20:.1f} MiB, LlamaDiskCache "
            f"{disk.written_per_turn / 2**20:.0f} MiB"
        )
        if server.written_per_turn:
            line += f", llama-server {server.written_per_turn / 2**20:.0f} MiB"
        lines.append(line)
    for row in report.rows:
        if row.missing:
            lines.append(f"{row.peer}: {row.missing}")
    return lines


def format_peers(report: PeersReport) -> str:
    mib = 2**20
    sizes = [str(s) for s in report.sizes]
    lines = [*peers_headline(report), "", machine_line(report.machine)]
    lines.append(
        f"took {report.elapsed_s:.0f} s (estimated {report.estimate_s:.0f} s); each row on "
        f"the same conversations: {', '.join(f'{int(s):,}' for s in sizes)} tokens, "
        f"{report.turns} turns, {report.conversations} conversations on one "
        f"{report.prefix_tokens:,}-token prefix"
    )
    header = (
        f"{'':<18} {'first word':>16} {'sooner':>12} {'own read':>14} {'÷own':>11} "
        f"{'greedy':>6} {'save/turn':>9} {'written':>7} {'turn':>5} {'shared':>22}"
    )
    lines += ["", header, "-" * len(header)]
    for row in report.rows:
        if row.missing:
            lines.append(f"{row.peer:<18} {row.missing}")
            continue
        greedy = "—" if row.greedy_equal is None else ("yes" if row.greedy_equal else "NO")
        save = f"{row.save_ms_per_turn:.0f} ms" if row.save_ms_per_turn is not None else "—"
        if row.written_per_turn == 0:
            written = "0"
        elif row.written_over_new_kv is not None:
            written = f"{row.written_over_new_kv:.1f}×"
        else:
            written = "—"
        turn = f"{row.turn_over_reread:.2f}×" if row.turn_over_reread is not None else "—"
        if row.shared_disk_bytes == 0:
            shared = "0"
        elif row.shared_disk_bytes and row.shared_over_kv is not None:
            shared = f"{row.shared_disk_bytes / mib:,.0f} MiB {row.shared_over_kv:.1f}×"
        else:
            shared = "—"
        if row.shared_kept is not None and row.shared_disk_bytes:
            shared += f" {row.shared_kept}/{report.conversations}"
        lines.append(
            f"{row.peer:<18} {_cell(sizes, row.ttft_ms, seconds_words):>16} "
            f"{_cell(sizes, row.sooner, times_words):>12} "
            f"{_cell(sizes, row.own_reread_ms, seconds_words):>14} "
            f"{_cell(sizes, row.sooner_than_own, times_words):>11} {greedy:>6} {save:>9} "
            f"{written:>7} {turn:>5} {shared:>22}"
        )
    lines += column_notes(PEER_COLUMNS)
    lines += ["", "a snapshot made with another KV type:"]
    for row in report.rows:
        if not row.missing:
            lines.append(f"  {row.peer}: {row.foreign}")
    lines += ["", "the rows:"]
    for row in report.rows:
        lines.append(f"  {row.peer}: {row.how}")
    return "\n".join(lines)
