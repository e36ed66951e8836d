"""Quantized KV end to end: q8_0 and q4_0 (with flash attention) save, resume, and refuse
to load into another KV type.

Flash attention is slow on a small CPU at long contexts, so these turns stay a few dozen
tokens long in a 256-token context.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SMALL = ["--temperature", "0", "--max-tokens", "16", "--n-ctx", "256", "--threads", "1"]
# Seq-state bytes: 16 (u64 magic, u32 streams, u32 cells) + 12 per cell (pos, n_seq, seq id)
# + 8 (v_trans, n_layer) + 30 layers × (12 for K + 12 for V) headers + KV rows per cell:
# 30 layers × 3 KV heads × 64 dims, K and V: f16 2 B/elem, q8_0 34 B/32, q4_0 18 B/32.
HEADERS = 16 + 8 + 30 * 24
ROW_BYTES = {"f16": 2 * 192 * 2 * 30, "q8_0": 2 * 204 * 30, "q4_0": 2 * 108 * 30}


def snapshot(home: Path, session: str) -> tuple[int, int, str]:
    row = (
        sqlite3.connect(home / "kvchat.db")
        .execute(
            "SELECT n_tokens, n_bytes, fingerprint FROM kv_snapshots WHERE session_id=?", (session,)
        )
        .fetchone()
    )
    return row[0], row[1], row[2]


def test_q8_0_session_resumes_from_disk_with_q8_0(kvhome: Path, copy_home, cli):
    first = cli(kvhome, "ask", "--new", "Hi", "--kv-type", "q8_0", "--json", *SMALL).json
    session = first["session"]
    n_tokens, n_bytes, fingerprint = snapshot(kvhome, session)
    assert '"type_k": "q8_0"' in fingerprint and '"type_v": "q8_0"' in fingerprint
    assert '"flash_attn": true' in fingerprint
    assert n_bytes == HEADERS + n_tokens * (12 + ROW_BYTES["q8_0"])  # 12,252 bytes a token
    other = copy_home(kvhome, "f16")

    second = cli(
        kvhome, "ask", "--session", session, "And then?", "--kv-type", "q8_0", "--json", *SMALL
    ).json
    assert second["restore"]["from"] == "disk"
    assert second["restore"]["reason"] is None
    assert second["restore"]["tokens"] == n_tokens
    assert second["tokens"]["reused"] == n_tokens
    assert 0 < second["tokens"]["decoded"] < 32
    assert second["reply"]

    # The same q8_0 snapshot into an f16 context: refused, with the KV types named.
    fallback = cli(
        other, "ask", "--session", session, "And then?", "--kv-type", "f16", "--json", *SMALL
    ).json
    reason = fallback["restore"]["reason"]
    assert fallback["restore"]["from"] == "none"
    assert "KV type" in reason and "q8_0" in reason and "type_k=f16" in reason
    assert fallback["tokens"]["reused"] == 0
    assert fallback["tokens"]["decoded"] == fallback["tokens"]["prompt"]
    assert fallback["reply"]


def test_f16_snapshot_resumed_as_q4_0_falls_back_then_q4_0_resumes(kvhome: Path, cli):
    home = kvhome
    session = cli(home, "ask", "--new", "Hi", "--json", *SMALL).json["session"]
    q4 = ["--kv-type", "q4_0", "--json", *SMALL]
    n_f16, bytes_f16, _ = snapshot(home, session)
    assert bytes_f16 == HEADERS + n_f16 * (12 + ROW_BYTES["f16"])  # 23,052 bytes a token

    fallback = cli(home, "ask", "--session", session, "And then?", *q4).json
    reason = fallback["restore"]["reason"]
    assert fallback["restore"]["from"] == "none"
    assert "KV type" in reason and "type_k=f16" in reason and "type_k=q4_0" in reason
    assert fallback["tokens"]["decoded"] == fallback["tokens"]["prompt"]
    n_tokens, n_bytes, fingerprint = snapshot(home, session)
    assert '"type_v": "q4_0"' in fingerprint
    assert n_bytes == HEADERS + n_tokens * (12 + ROW_BYTES["q4_0"])  # 6,492 bytes a token

    resumed = cli(home, "ask", "--session", session, "Why?", *q4).json
    assert resumed["restore"]["from"] == "disk"
    assert resumed["restore"]["reason"] is None
    assert resumed["tokens"]["reused"] == n_tokens
    assert 0 < resumed["tokens"]["decoded"] < 32
