"""The two background threads of the app.

The engine thread runs every call that touches the model (load, send, regenerate,
make_hot, save, delete, close) one after another: ChatService and the llama.cpp
context are not thread-safe, and a new generation must start only after the previous
one has finished. The store thread runs reads and store-only writes, so a slow query
never blocks the UI and never waits behind a generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class SerialThread:
    """One worker thread; ``run`` queues a call and returns an awaitable for its result."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvchat-{name}")
        self._closed = False

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args, **kwargs)``; await the result on the UI loop without blocking it."""
        return asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue a call before the UI loop runs (at the app's construction); await it later
        with :func:`asyncio.wrap_future`."""
        return self._executor.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Queue a call and block until it returns (only for shutdown)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True)
