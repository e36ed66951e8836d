"""The engine seam stays narrow: a small core protocol, roles asked for by capability, and no
class in the engines, the KV tiers or the service that inherits implementation."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvchat.engine import api

APP = Path(__file__).resolve().parents[3] / "app" / "kvchat"
# Classes a class may derive from: protocols, exceptions and typed value records.
VALUE_BASES = {"Protocol", "NamedTuple", "BaseModel", "Exception"}


def _protocol_members(cls: type) -> set[str]:
    own = set(cls.__dict__.get("__annotations__", {}))
    own |= {name for name in vars(cls) if not name.startswith("_")}
    return own


def test_the_core_engine_protocol_has_at_most_twelve_members() -> None:
    members = _protocol_members(api.Engine)
    assert len(members) <= 12, sorted(members)
    assert {"capabilities", "token_level", "seq_state", "server_slots", "remote_chat"} <= members


def test_roles_are_protocols_apart_from_the_core() -> None:
    core = _protocol_members(api.Engine)
    for role in (api.TokenEngine, api.SeqStateEngine, api.SlotEngine, api.RemoteChatEngine):
        assert not (_protocol_members(role) & core), role.__name__


def _sources(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((APP / package).rglob("*.py"))]


def test_the_engines_and_the_service_never_ask_an_engine_its_type() -> None:
    found = []
    for path in _sources("engine", "service"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"isinstance\(.*Engine|hasattr\(", line):
                found.append(f"{path.relative_to(APP)}:{n}: {line.strip()}")
    assert not found, found


def _implementation_bases(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            name = ast.unparse(base).split(".")[-1]
            if name in VALUE_BASES or name.endswith(("Error", "Protocol")) or name == "_Strict":
                continue
            if name in {"Engine", "TokenEngine"} and "Protocol" in map(ast.unparse, node.bases):
                continue  # a role protocol extending the core protocol
            bad.append(f"{path.relative_to(APP)}: class {node.name}({name})")
    return bad


def test_no_engine_or_kv_tier_class_inherits_implementation() -> None:
    found = [bad for path in _sources("engine", "kvcache") for bad in _implementation_bases(path)]
    assert not found, found
