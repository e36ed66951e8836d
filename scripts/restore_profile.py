"""Where a chunk restore's time goes, against llama.cpp's own loader of the same state.

    python scripts/restore_profile.py [--tokens 4096] [--flash-attn on|off] [--repeat 7]

One history of about ``--tokens`` tokens (the bundled model unless KVCHAT_MODEL says
otherwise) is snapshotted in a scratch home, then restored ``--repeat`` times, each time
in turn with ``llama_state_seq_load_file`` of the same state (warm page cache). The parts
of each restore are timed by wrapping the calls the loader makes, nothing changed in it:

* read: ``preadv`` of the chunk files into place;
* checksum: xxh3 over each batch just read;
* copy: what else happens to a piece between its read and llama.cpp (PieceReader.read
  less read and checksum: headers, the transposed-V scatter);
* set_data: llama.cpp copying each piece into the KV cache (``state_append``), plus
  emptying the context first and adopting the tokens' positions last;
* validate: the rest of the restore (the index rows, the chain's keys, layouts, file sizes).

Prints a JSON object: medians in ms of each part, the restore, the loader and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Parts:
    """Seconds spent in each wrapped call since the last reset."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def reset(self) -> None:
        self.spent = {}

    def add(self, name: str, seconds: float) -> None:
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)

        return timed


class _TimedDigest:
    def __init__(self, parts: Parts, digest: Any) -> None:
        self._parts, self._digest = parts, digest

    def update(self, data: Any) -> None:
        started = time.perf_counter()
        self._digest.update(data)
        self._parts.add("checksum", time.perf_counter() - started)

    def hexdigest(self) -> str:
        return str(self._digest.hexdigest())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="off")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    import xxhash

    from kvchat.bench.runs import _page_cache, _prepare
    from kvchat.config import Settings
    from kvchat.kvcache.cold import chunk_reader
    from kvchat.service.chat import open_service

    parts = Parts()
    chunk_reader.kvfiles.read_into = parts.wrap("read", chunk_reader.kvfiles.read_into)

    class _Hash:
        @staticmethod
        def xxh3_128(data: Any = b"") -> _TimedDigest:
            started = time.perf_counter()
            digest = xxhash.xxh3_128(data)
            parts.add("checksum", time.perf_counter() - started)
            return _TimedDigest(parts, digest)

    chunk_reader.xxhash = _Hash  # type: ignore[assignment]
    chunk_reader.PieceReader.read = parts.wrap("piece", chunk_reader.PieceReader.read)
    chunk_reader.ChunkReader.read = parts.wrap("piece", chunk_reader.ChunkReader.read)

    settings = Settings().model_copy(update={"flash_attn": args.flash_attn == "on"})
    rows: dict[str, list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-profile-") as scratch,
        open_service(settings, home=Path(scratch)) as service,
    ):
        engine = service.load_engine()
        tiers = service.host.tiers
        prep = _prepare(service, args.tokens, lambda line: print(line, file=sys.stderr))
        for name, label in (
            ("state_append", "set_data"),
            ("clear", "clear"),
            ("state_adopt", "adopt"),
        ):
            setattr(engine, name, parts.wrap(label, getattr(engine, name)))
        fingerprint = tiers.fingerprint
        for _ in range(args.repeat):
            _page_cache(prep.files, False)
            started = time.perf_counter()
            engine.state_load_file(prep.limit_path)
            rows.setdefault("loader", []).append((time.perf_counter() - started) * 1000)
            _page_cache(prep.files, False)
            parts.reset()
            result = tiers.cold.restore(prep.session_id, engine, fingerprint)
            if result.source != "disk":
                print(f"restore failed: {result.reason}", file=sys.stderr)
                return 1
            spent = {k: v * 1000 for k, v in parts.spent.items()}
            read, checksum = spent.get("read", 0.0), spent.get("checksum", 0.0)
            piece = spent.get("piece", 0.0)
            set_data = (
                spent.get("set_data", 0.0) + spent.get("clear", 0.0) + spent.get("adopt", 0.0)
            )
            rows.setdefault("restore", []).append(result.ms)
            rows.setdefault("read", []).append(read)
            rows.setdefault("checksum", []).append(checksum)
            rows.setdefault("copy", []).append(max(0.0, piece - read - checksum))
            rows.setdefault("set_data", []).append(set_data)
            rows.setdefault("validate", []).append(max(0.0, result.ms - piece - set_data))
            tiers.mark_hot(None)
        medians = {k: round(statistics.median(v), 2) for k, v in rows.items()}
        report = {
            "tokens": prep.row.n_tokens,
            "snapshot_bytes": prep.row.n_bytes,
            "chunks": len(prep.row.chunk_keys),
            "flash_attn": args.flash_attn == "on",
            "repeat": args.repeat,
            "median_ms": medians,
            "restore_over_loader": round(medians["restore"] / medians["loader"], 3),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
