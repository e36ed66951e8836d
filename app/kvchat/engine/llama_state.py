"""The llama.cpp engine's sequence state: the raw seq-state bytes in and out, llama.cpp's own
state files (the benchmark's reference), and window checkpoints of sliding-window models.

State bytes pass through one reusable buffer (:class:`StateBuffer`): a fresh allocation
of ~100 MB page-faults on every touch, and a buffer backed by huge pages costs the copies
into and out of it fewer TLB misses.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp

SEQ_ID = 0
# llama.cpp loads a seq state only into an emptied sequence, so a state loaded piece by
# piece goes through this one and its cells are then handed to SEQ_ID (no copy: the
# context's cache is unified, so the cells just change owner).
SCRATCH_SEQ = 1
# Window checkpoints (sliding-window models) kept in memory: a turn takes two (where a
# regenerate and where the next turn start), each a whole window. The next save writes
# them to disk; the newest stay in RAM after it, so a regenerate, an edit or a fork a few
# messages back cuts the hot context there without reading the disk.
MAX_HELD_CHECKPOINTS = 8
# ... within this many bytes (a window of Gemma 3 4B is ~120 MB), the two newest always.
MAX_HELD_BYTES = 512 << 20
# Buffers are sized in whole huge pages, with room to grow: a state grows every turn.
HUGE_PAGE = 2 << 20
GROWTH = 1.25
# ... but never more than this beyond what was asked (a long context's state is gigabytes).
MAX_HEADROOM = 64 << 20


# Held while llama_cpp's default-params functions are patched (a model or context is made).
PARAMS_LOCK = threading.RLock()


@contextmanager
def scratch_sequence(wanted: bool = True) -> Iterator[None]:
    """Contexts created inside this block (by ``llama_cpp.Llama``, which takes no such
    argument) get :data:`SCRATCH_SEQ` beside sequence 0, in one unified cache of n_ctx
    cells: what :meth:`ContextState.state_append` needs. Decoding one sequence in it is
    what it is in a single-sequence context. ``wanted`` False: sequence 0 alone."""
    module = llama_cpp.llama_cpp
    with PARAMS_LOCK:
        defaults = module.llama_context_default_params

        def with_scratch() -> Any:
            params = defaults()
            params.n_seq_max = SCRATCH_SEQ + 1 if wanted else 1
            params.kv_unified = True
            return params

        module.llama_context_default_params = with_scratch
        try:
            yield
        finally:
            module.llama_context_default_params = defaults


class StateBuffer:
    """One anonymous mapping reused for every state read or written, grown when too small.

    Asked for huge pages (``MADV_HUGEPAGE``; only advice where the kernel lacks them).
    """

    def __init__(self) -> None:
        self._array: ctypes.Array[ctypes.c_uint8] | None = None

    def get(self, size: int) -> ctypes.Array[ctypes.c_uint8]:
        """A buffer of at least ``size`` bytes (its contents are whatever was there)."""
        if self._array is None or len(self._array) < size:
            grown = int(len(self._array) * GROWTH) if self._array is not None else 0
            grown = min(grown, size + MAX_HEADROOM)
            capacity = -(-max(size, grown, 1) // HUGE_PAGE) * HUGE_PAGE
            mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    mapping.madvise(advice)
                except OSError:
                    pass
            # The array keeps the mapping alive; the old one goes when its last view does.
            self._array = (ctypes.c_uint8 * capacity).from_buffer(mapping)
        return self._array


class ContextState:
    """Sequence 0's KV in a llama.cpp context as raw bytes, llama.cpp's own state files, and
    the window checkpoints of sliding-window (and recurrent) models. The llama.cpp engine
    holds one and hands its ``state_*`` members on; the token list it shares is ``llm``'s."""

    def __init__(
        self,
        llm: Any,
        n_swa: int,
        recurrent: bool,
        interleaved: bool,
        n_gpu_layers: int,
    ) -> None:
        self.llm = llm
        self.ctx = llm._ctx.ctx
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_swa = n_swa
        self.recurrent = recurrent
        self.interleaved = interleaved
        self.n_gpu_layers = n_gpu_layers
        # Window checkpoints by position (each valid while the context keeps the tokens
        # before it: a cut below one drops it), and those no save has taken yet.
        self.held: dict[int, ctypes.Array[ctypes.c_uint8]] = {}
        self.unsaved: set[int] = set()
        self._buffer = StateBuffer()

    @property
    def n_tokens(self) -> int:
        return int(self.llm.n_tokens)

    def clear(self) -> None:
        """Empty the context (the KV of every sequence, the token list, the checkpoints)."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), -1, -1, -1)
        self.llm.n_tokens = 0
        self.forget_checkpoints()

    # --- window checkpoints (sliding-window models) -------------------------------------

    def window_low(self) -> int:
        """The lowest position whose cells the sliding-window cache still holds (llama.cpp's
        interleaved cache answers seq_pos_min from it); -1 when empty.

        Without swa_full the cache is a ring of ``pad256(n_swa + n_ubatch)`` cells, filled
        in position order: a cell is overwritten only once it has left every window, the
        lowest position first, so the cache holds every position from here on. A restored
        state holds only its last ``n_swa`` cells."""
        return int(llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(self.ctx), SEQ_ID))

    def capture(self) -> None:
        """Keep the window's cells at the current position (llama.cpp's partial state: the
        sliding-window cache alone), if the context really holds all of them."""
        n = self.n_tokens
        if not n or n in self.held:
            return
        low = self.window_low() if self.interleaved else 0
        if low > 0 and n < low + self.n_swa:
            return
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, SEQ_ID, flags))
        buf = (ctypes.c_uint8 * size)()
        if (
            not size
            or llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, SEQ_ID, flags) != size
        ):
            return
        self.held[n] = buf
        if self.interleaved:  # window pieces go to disk; a recurrent state stays in RAM
            self.unsaved.add(n)
        self.trim_held()

    def trim_held(self) -> None:
        """Forget the oldest held checkpoints beyond the count and byte limits (never the
        two newest, nor one no save has taken yet)."""
        while len(self.held) > 2:
            total = sum(len(buf) for buf in self.held.values())
            if len(self.held) <= MAX_HELD_CHECKPOINTS and total <= MAX_HELD_BYTES:
                return
            spare = sorted(self.held)[:-2]
            saved = [pos for pos in spare if pos not in self.unsaved]
            if not saved:
                return
            del self.held[saved[0]]

    def forget_checkpoints(self, above: int = -1) -> None:
        """Drop the held checkpoints at positions above ``above`` (all: -1)."""
        for pos in [pos for pos in self.held if pos > above]:
            del self.held[pos]
            self.unsaved.discard(pos)

    def take_checkpoints(self) -> list[tuple[int, Any]]:
        """Window checkpoints taken since the last call, as (position, partial state) with
        the context still holding the tokens before each position. They stay held in RAM
        (see :meth:`held_checkpoint`) until the context is cut below them."""
        taken = sorted((pos, self.held[pos]) for pos in self.unsaved if pos <= self.n_tokens)
        self.unsaved.clear()
        return taken

    def held_checkpoint(self, limit: int) -> int:
        """The furthest held window checkpoint at or below ``limit`` (0: none)."""
        below = [pos for pos in self.held if 0 < pos <= min(limit, self.n_tokens)]
        return max(below, default=0)

    def load_window(self, position: int) -> bool:
        """Load the held checkpoint at ``position`` (llama.cpp's partial state: the
        sliding-window cache, or the recurrent state) and cut the rest of the context (its
        full-attention cells) there. False, with the context emptied, when llama.cpp
        refuses it."""
        buf = self.held[position]
        mem = llama_cpp.llama_get_memory(self.ctx)
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        loaded = llama_cpp.llama_state_seq_set_data_ext(self.ctx, buf, len(buf), SEQ_ID, flags)
        # The state now ends at position - 1: llama.cpp cuts the cells after it.
        ok = loaded == len(buf) and llama_cpp.llama_memory_seq_rm(mem, SEQ_ID, position, -1)
        if ok and self.interleaved:
            ok = self.window_low() == max(0, position - self.n_swa)
        if ok and self.recurrent:
            ok = int(llama_cpp.llama_memory_seq_pos_max(mem, SEQ_ID)) == position - 1
        if not ok:
            self.clear()
            return False
        self.llm.n_tokens = position
        self.forget_checkpoints(above=position)
        return True

    # --- sequence state -------------------------------------------------------------------

    def state_size(self) -> int:
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, SEQ_ID))

    def state_buffer(self, size: int) -> ctypes.Array[ctypes.c_uint8]:
        """A reusable buffer of at least ``size`` bytes (see :class:`StateBuffer`)."""
        return self._buffer.get(size)

    def state_get(self) -> memoryview:
        """The seq-state bytes of the context, as a view into the engine's reusable buffer."""
        size = self.state_size()
        buf = self.state_buffer(size)
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, SEQ_ID)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return memoryview(buf).cast("B")[:size]

    def state_set(self, buf: Any, size: int, tokens: Sequence[int]) -> bool:
        """Load ``size`` seq-state bytes from ``buf`` (a ctypes array or uint8 pointer).

        On success the context holds ``tokens``; on failure it is empty.
        """
        self.clear()
        loaded = llama_cpp.llama_state_seq_set_data(self.ctx, buf, size, SEQ_ID)
        if loaded != size:
            self.clear()
            return False
        self._adopt(tokens)
        return True

    @property
    def appends_state(self) -> bool:
        """Whether :meth:`state_append` works here: the context has the scratch sequence
        and its KV lives in host memory (on a GPU, many small uploads would cost more than
        one big one)."""
        return (
            int(llama_cpp.llama_n_seq_max(self.ctx)) > SCRATCH_SEQ
            and not self.interleaved
            and (self.n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload())
        )

    def state_append(self, buf: Any, size: int, below: int) -> bool:
        """Add the cells of a seq state (``size`` bytes at ``buf``) whose positions are
        below ``below`` to sequence 0, after the cells it holds; the rest are dropped.

        A whole state can so be loaded one piece at a time, each piece read while it is
        still in the CPU's cache (see :mod:`kvchat.kvcache.cold.chunk_reader`). Start with
        :meth:`clear` and end with :meth:`state_adopt`. On failure the context is empty.
        """
        if not self.appends_state:
            raise RuntimeError("this context has no scratch sequence to load pieces through")
        mem = llama_cpp.llama_get_memory(self.ctx)
        loaded = llama_cpp.llama_state_seq_set_data(self.ctx, buf, size, SCRATCH_SEQ)
        if loaded == size:
            llama_cpp.llama_memory_seq_cp(mem, SCRATCH_SEQ, SEQ_ID, -1, below)
        llama_cpp.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
        if loaded != size:
            self.clear()
            return False
        return True

    def state_adopt(self, tokens: Sequence[int]) -> bool:
        """After :meth:`state_append`: the context holds ``tokens`` if sequence 0's cells
        are exactly positions 0 … len(tokens) - 1; otherwise it is emptied (False)."""
        mem = llama_cpp.llama_get_memory(self.ctx)
        n = len(tokens)
        low = int(llama_cpp.llama_memory_seq_pos_min(mem, SEQ_ID))
        high = int(llama_cpp.llama_memory_seq_pos_max(mem, SEQ_ID))
        if (low, high) != ((0, n - 1) if n else (-1, -1)):
            self.clear()
            return False
        self._adopt(tokens)
        return True

    def _adopt(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        self.llm.input_ids[:n] = tokens
        self.llm.n_tokens = n

    def state_save_file(self, path: Path) -> int:
        """llama.cpp's own seq-state file writer (the benchmark's reference)."""
        ids = [int(t) for t in self.llm.input_ids[: self.n_tokens]]
        tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        return int(
            llama_cpp.llama_state_seq_save_file(
                self.ctx, os.fsencode(path), SEQ_ID, tokens, self.n_tokens
            )
        )

    def state_load_file(self, path: Path) -> int:
        """llama.cpp's own seq-state file reader (the benchmark's limit); returns bytes read."""
        self.clear()
        capacity = self.n_ctx
        tokens = (llama_cpp.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(
            self.ctx, os.fsencode(path), SEQ_ID, tokens, capacity, ctypes.byref(count)
        )
        n = int(count.value)
        self.llm.input_ids[:n] = list(tokens[:n])
        self.llm.n_tokens = n
        return int(read)
