"""The queue owner. Callers append sequences and await their futures; the batcher forms batches with the
policy, keeps exactly one prepared batch ready while the previous one computes, and runs the compute
function on a thread, off the event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from embed_service import metrics
from embed_service.batching.policy import BatchPolicy, OldestFirst
from embed_service.batching.sequence import Sequence

log = logging.getLogger(__name__)

# (flat token ids (T,) int32, lengths (B,) int32) -> one result object per sequence
ComputeFn = Callable[[np.ndarray, np.ndarray], list[Any]]


class Batcher:
    def __init__(
        self,
        compute: ComputeFn,
        max_batch_tokens: int,
        max_batch_requests: int,
        model: str,
        policy: BatchPolicy | None = None,
    ):
        self.compute = compute
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.policy = policy or OldestFirst()
        self.queue: deque[Sequence] = deque()
        self.model = model
        self._wakeup = asyncio.Event()
        self._prepared: asyncio.Queue[tuple[list[Sequence], np.ndarray, np.ndarray]] = asyncio.Queue(
            maxsize=1
        )
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{model}")
        self._tasks: list[asyncio.Task] = []
        self._queue_gauge = metrics.QUEUE_SIZE.labels(model)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._form_loop()), asyncio.create_task(self._run_loop())]

    def submit(self, seqs: list[Sequence]) -> None:
        now = time.perf_counter()
        for s in seqs:
            s.enqueued_at = now
        self.queue.extend(seqs)
        self._queue_gauge.set(len(self.queue))
        self._wakeup.set()

    def fail_all(self, exc: BaseException) -> None:
        """Answer every waiting sequence with an error (the compute backend is gone)."""
        while self.queue:
            s = self.queue.popleft()
            if not s.future.done():
                s.future.set_exception(exc)
        self._queue_gauge.set(0)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _form_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            batch = self.policy.take(self.queue, self.max_batch_tokens, self.max_batch_requests)
            self._queue_gauge.set(len(self.queue))
            if not self.queue:
                self._wakeup.clear()
            if not batch:
                continue
            lengths = np.fromiter((len(s.ids) for s in batch), dtype=np.int32, count=len(batch))
            ids = np.fromiter((t for s in batch for t in s.ids), dtype=np.int32, count=int(lengths.sum()))
            await self._prepared.put((batch, ids, lengths))  # waits while one prepared batch is pending

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch, ids, lengths = await self._prepared.get()
            start = time.perf_counter()
            for s in batch:
                metrics.QUEUE_DURATION.labels(self.model).observe(start - s.enqueued_at)
            metrics.BATCH_SIZE.labels(self.model).observe(len(batch))
            metrics.BATCH_TOKENS.labels(self.model).observe(len(ids))
            try:
                results = await loop.run_in_executor(self._thread, self.compute, ids, lengths)
            except Exception as exc:  # the engine maps it to an HTTP status
                for s in batch:
                    if not s.future.done():
                        s.future.set_exception(exc)
                continue
            metrics.INFERENCE_DURATION.labels(self.model).observe(time.perf_counter() - start)
            for s, r in zip(batch, results):
                if not s.future.done():
                    s.future.set_result(r)
