"""The engine probe's file (``engine-probe.json``), read at its boundary.

The file is kvchat's own, but it outlives the llama.cpp build and the machine that wrote it,
it can be shared (``KVCHAT_PROBE_FILE``) and edited by hand, and what it says decides native
code that can crash the process. So it is read as a door from outside: one bounded read (a
regular file, never through a link, at most :data:`MAX_FILE_BYTES`, without blocking on a
FIFO or a device), parsed once into typed, bounded values; an outcome that does not fit is
dropped (its combination is probed again), a file that does not fit is read as empty, and
text in it (failures, a model's name) reaches the terminal only as plain text.

Beside the file, a process that runs a model on a verdict leaves a marker
(``<file>.use-<pid>``) naming the verdict and its crash log; it is removed when the process
ends normally. A marker left by a process whose crash log holds a report means the verdict
crashed in use: :meth:`ProbeBook.withdraw_crashed` marks it so, and the next start probes
again from the next safer combination.
"""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from kvchat.errors import KvchatError
from kvchat.paths import open_regular
from kvchat.system import LockBusy
from kvchat.system import current as current_system
from kvchat.text import one_line

# The file is a few KB per combination; more than this is not a probe file.
MAX_FILE_BYTES = 1 << 20
# Outcomes kept in one file (the oldest go first when a new one is written).
MAX_OUTCOMES = 64
# Thread counts a verdict may name, and the speeds it may claim (tokens per second).
MAX_THREADS = 1024
MAX_SPEED = 1e7
# -1 is "every layer"; no model has more layers than this.
MAX_LAYERS = 4096
USE_MARKER = ".use-"


def _plain(limit: int) -> Any:
    """A string shown to the user: at most ``limit`` characters, on one line, no escapes."""
    return AfterValidator(lambda text: one_line(text)[:limit])


Short = Annotated[StrictStr, Field(max_length=400), _plain(200)]
KvType = Literal["f16", "q8_0", "q4_0"]
Speed = Annotated[float, Field(ge=0.0, le=MAX_SPEED, allow_inf_nan=False)]
ThreadCount = Annotated[StrictStr, Field(pattern=r"^[1-9][0-9]{0,3}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TrialRecord(_Strict):
    """A combination of the options that can crash llama.cpp, as the file holds it."""

    repack: StrictBool
    flash_attn: StrictBool
    n_gpu_layers: Annotated[StrictInt, Field(ge=-1, le=MAX_LAYERS)]
    type_k: KvType = "f16"
    type_v: KvType = "f16"


class OutcomeRecord(_Strict):
    """One combination's verdict, as the file holds it (see ``ProbeOutcome``)."""

    key: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{24}$")]
    trial: TrialRecord
    wanted: TrialRecord
    failures: Annotated[list[Short], Field(max_length=16)] = []
    speeds: Annotated[
        dict[ThreadCount, dict[Literal["prefill", "generate"], Speed]], Field(max_length=64)
    ] = {}
    probe_ms: Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)] = 0.0
    when: Annotated[StrictStr, Field(max_length=40), _plain(40)] = ""
    amx: StrictBool = False
    recheck: Short = ""
    model_bytes: Annotated[StrictInt, Field(ge=0, le=1 << 50)] = 0
    model_name: Short = ""
    # Why this verdict no longer holds (it crashed in use), or "".
    withdrawn: Short = ""

    def speeds_within(self, limit: int = MAX_THREADS) -> bool:
        return all(int(n) <= limit for n in self.speeds)


class UseMarker(_Strict):
    """What a process running a model on a verdict leaves beside the file."""

    key: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{24}$")]
    crash_log: Annotated[StrictStr, Field(max_length=4096)] = ""


def read_bounded(path: Path, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """The bytes of the regular file at ``path`` (not through a link, never blocking on a
    FIFO or device), or None when there is none or it is larger than ``limit``."""
    try:
        fd, size = open_regular(path, follow_links=False)
    except OSError:
        return None
    try:
        if size > limit:
            return None
        chunks, got = [], 0
        while got <= limit:  # the file may grow after fstat: read no more than limit + 1
            chunk = os.read(fd, min(1 << 16, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return None if got > limit else b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_outcomes(raw: bytes) -> dict[str, OutcomeRecord]:
    """The outcomes a probe file holds, each checked on its own: an entry that does not fit
    is left out (probed again); a file that is not a JSON object of outcomes gives none."""
    try:
        # pydantic's JSON parser bounds nesting depth itself (no RecursionError).
        data = _FileShape.model_validate_json(raw)
    except ValidationError:
        return {}
    outcomes: dict[str, OutcomeRecord] = {}
    for key, entry in list(data.outcomes.items())[: MAX_OUTCOMES * 4]:
        try:
            record = OutcomeRecord.model_validate(entry)
        except ValidationError:
            continue
        if record.key == key:
            outcomes[key] = record
    return outcomes


class _FileShape(BaseModel):
    model_config = ConfigDict(extra="ignore")
    outcomes: dict[str, dict[str, Any]] = {}


def parse_marker(raw: bytes) -> UseMarker | None:
    try:
        return UseMarker.model_validate_json(raw)
    except ValidationError:
        return None


# How long a change of the file waits for another process's (a probe writes once a model).
LOCK_WAIT_S = 5.0


class ProbeBook:
    """The outcomes file: one JSON object, written whole to a temporary name and renamed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, OutcomeRecord]:
        raw = read_bounded(self.path)
        return parse_outcomes(raw) if raw is not None else {}

    def get(self, key: str) -> OutcomeRecord | None:
        return self.read().get(key)

    def records(self) -> list[OutcomeRecord]:
        """Every outcome in the file, the newest first (one read, one parse)."""
        return sorted(self.read().values(), key=lambda record: record.when, reverse=True)

    def put(self, record: OutcomeRecord) -> None:
        """Keep ``record`` (best effort: an unwritable directory, or a file another process
        holds for over :data:`LOCK_WAIT_S`, means probing again)."""
        with self._changing() as held:
            if not held:
                return
            outcomes = self.read()
            outcomes[record.key] = record
            newest = sorted(outcomes.values(), key=lambda r: r.when, reverse=True)
            self._write({r.key: r.model_dump(mode="json") for r in newest[:MAX_OUTCOMES]})

    @contextmanager
    def _changing(self) -> Iterator[bool]:
        """Hold the file's lock for a read, change and write, so that two processes writing
        at once (two kvchat, a shared KVCHAT_PROBE_FILE, a test run's workers) do not drop
        each other's outcomes. Yields whether the lock is held."""
        from kvchat.paths import ensure_private_dir

        lock = self.path.with_name(f".{self.path.name}.lock")
        held = ExitStack()
        try:
            ensure_private_dir(self.path.parent)
            held.enter_context(current_system().hold_lock(lock, LOCK_WAIT_S))
        except (OSError, LockBusy):
            yield False
            return
        with held:
            yield True

    def _write(self, outcomes: dict[str, Any]) -> None:
        from kvchat.paths import ensure_private_dir

        try:
            ensure_private_dir(self.path.parent)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            fd = current_system().open_no_follow(temporary, flags)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": 1, "outcomes": outcomes}, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temporary, self.path)
        except (OSError, KvchatError):
            pass

    # ------------------------------------------------------------ verdicts in use

    def mark_in_use(self, key: str, crash_log: Path | None) -> None:
        """Say that this process runs a model on the verdict ``key`` (removed at a normal
        exit): if the process dies in a crash, the next start withdraws the verdict."""
        marker = self.path.with_name(f"{self.path.name}{USE_MARKER}{os.getpid()}")
        body = UseMarker(key=key, crash_log=str(crash_log or "")).model_dump_json()
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            fd = current_system().open_no_follow(marker, flags)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(body)
        except OSError:
            return
        atexit.register(_remove, marker)

    def withdraw_crashed(self) -> list[str]:
        """Withdraw each verdict that a process crashed on (its marker left behind, its crash
        log holding a report); remove markers of processes gone. The keys withdrawn."""
        withdrawn: list[str] = []
        try:
            markers = list(self.path.parent.glob(f"{self.path.name}{USE_MARKER}*"))
        except OSError:
            return withdrawn
        for marker in markers[:1000]:
            pid = marker.name.rsplit(USE_MARKER, 1)[-1]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            raw = read_bounded(marker, 8192)
            found = parse_marker(raw) if raw is not None else None
            _remove(marker)
            if found is None or not found.crash_log:
                continue  # killed outright (or no crash log kept): not a crash of the engine
            report = read_bounded(Path(found.crash_log), 1 << 20)
            if report and b"Fatal Python error" in report:
                withdrawn.append(found.key)
        if withdrawn:
            with self._changing() as held:
                if held:
                    self._withdraw(withdrawn)
        return withdrawn

    def _withdraw(self, keys: list[str]) -> None:
        outcomes = self.read()
        for key in keys:
            record = outcomes.get(key)
            if record is not None:
                outcomes[key] = record.model_copy(
                    update={"withdrawn": "kvchat crashed in llama.cpp on these options"}
                )
        self._write({k: r.model_dump(mode="json") for k, r in outcomes.items()})


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    return current_system().pid_alive(pid)


__all__ = [
    "MAX_FILE_BYTES",
    "OutcomeRecord",
    "ProbeBook",
    "TrialRecord",
    "parse_outcomes",
    "read_bounded",
]
