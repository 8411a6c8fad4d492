"""The thread an `Embedder` (embedder.py) runs its engine on: an event loop of its own, on a daemon thread
that lives until `close()`, which closes the engine there first."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import TypeVar

from embed_service.engine.engine import Engine

T = TypeVar("T")


class EngineThread:
    """An event loop on a daemon thread, and the engine that lives on it. Kept apart from `Embedder` so
    that a finalizer can close it without holding the Embedder alive."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="embed-service-engine", daemon=True)
        self.thread.start()
        self.engine: Engine | None = None
        self.closed = False

    def submit(self, coro: Awaitable[T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def run(self, coro: Awaitable[T]) -> T:
        """Run `coro` on the engine's loop and wait; an interrupt (Ctrl-C) cancels it there."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.engine is not None and threading.current_thread() is not self.thread:
            try:
                self.run(self.engine.close())
            finally:
                self.engine = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join()
            self.loop.close()
