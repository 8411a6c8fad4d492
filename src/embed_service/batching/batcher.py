"""The queue owner. Callers append sequences and await their futures; the batcher forms batches with the
policy and runs the compute function on a thread, off the event loop.

Batches are formed when a compute backend is free (see policy.py for why); there is one backend per model
replica.
"""

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
from embed_service.batching.policy import PriorityFirst
from embed_service.batching.sequence import Sequence, mark_ran

log = logging.getLogger(__name__)

# (flat token ids (T,) int32, lengths (B,) int32) -> one result object per sequence
ComputeFn = Callable[[np.ndarray, np.ndarray], list[Any]]


class Batcher:
    """Two lanes (priority, bulk) and one run loop per compute backend (model replica).

    Every loop forms its batch when its backend is free: priority sequences first, then bulk ones. With
    two or more backends and `priority_batch_tokens` set, the last backend takes at most that many tokens
    per batch while interactive traffic is about (a priority request in the last `PRIORITY_HOLD_S`
    seconds), so it is free again soon for the next short request. Without interactive traffic it takes
    up to IDLE_RESERVE_FACTOR times that: one 150-token passage per forward runs at about half the
    tokens/s of a full batch, while a few thousand tokens run nearly as fast per token and still bound
    the wait of the first short request to arrive.
    """

    PRIORITY_HOLD_S = 2.0
    IDLE_RESERVE_FACTOR = 8

    def __init__(
        self,
        compute: ComputeFn | list[ComputeFn],
        max_batch_tokens: int,
        max_batch_requests: int,
        model: str,
        priority_batch_tokens: int = 0,
        bulk_aging_s: float = 0.0,
    ):
        self.backends = compute if isinstance(compute, list) else [compute]
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.policy = PriorityFirst(bulk_aging_s)
        self.queue: deque[Sequence] = deque()  # bulk lane
        self.priority: deque[Sequence] = deque()
        self.model = model
        self.priority_fill_tokens = priority_batch_tokens
        self.budgets = [max_batch_tokens] * len(self.backends)
        if priority_batch_tokens and len(self.backends) > 1:
            self.budgets[-1] = min(priority_batch_tokens, max_batch_tokens)
        self._priority_seen = -float("inf")  # perf_counter() of the last priority submission
        self._wakeups = [asyncio.Event() for _ in self.backends]
        self._busy = [False] * len(self.backends)
        self._threads: list[ThreadPoolExecutor] = []
        self._tasks: list[asyncio.Task] = []
        self._queue_gauge = metrics.QUEUE_SIZE.labels(model)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run_loop(i)) for i in range(len(self.backends))]

    def submit(self, seqs: list[Sequence], priority: bool = False) -> None:
        now = time.perf_counter()
        for s in seqs:
            s.enqueued_at = now
        if priority:
            self._priority_seen = now
        (self.priority if priority else self.queue).extend(seqs)
        self._update_gauge()
        for wakeup in self._wakeups:
            wakeup.set()

    def _update_gauge(self) -> None:
        self._queue_gauge.set(len(self.queue) + len(self.priority))

    def fail_all(self, exc: BaseException) -> None:
        """Answer every waiting sequence with an error (the compute backend is gone)."""
        for lane in (self.priority, self.queue):
            while lane:
                s = lane.popleft()
                if not s.future.done():
                    s.future.set_exception(exc)
        self._update_gauge()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self._threads:
            pool.shutdown(wait=False, cancel_futures=True)

    def _budget(self, index: int) -> int:
        """This backend's token budget now: the reserved (last) one is small while interactive traffic is
        about, moderate otherwise."""
        if self.budgets[index] >= self.max_batch_tokens:
            return self.max_batch_tokens
        if time.perf_counter() - self._priority_seen < self.PRIORITY_HOLD_S:
            return self.budgets[index]
        return min(self.max_batch_tokens, self.IDLE_RESERVE_FACTOR * self.budgets[index])

    def _share(self, budget: int) -> int:
        """With other replicas idle, take only a fair part of what waits, so that they all compute
        (4 requests of 32 short queries are one batch's worth, but two replicas finish them sooner)."""
        free = self._busy.count(False)
        if free <= 1:
            return budget
        waiting = sum(len(s.ids) for s in self.priority) + sum(len(s.ids) for s in self.queue)
        return max(1, min(budget, -(-waiting // free)))

    async def _run_loop(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        compute, wakeup = self.backends[index], self._wakeups[index]
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{self.model}-{index}")
        self._threads.append(pool)
        while True:
            await wakeup.wait()
            batch = self.policy.take_lanes(
                self.priority,
                self.queue,
                self._share(self._budget(index)),
                self.max_batch_requests,
                self.priority_fill_tokens,
            )
            self._update_gauge()
            if not (self.queue or self.priority):
                wakeup.clear()
            if not batch:
                continue
            lengths = np.fromiter((len(s.ids) for s in batch), dtype=np.int32, count=len(batch))
            ids = np.fromiter((t for s in batch for t in s.ids), dtype=np.int32, count=int(lengths.sum()))
            start = time.perf_counter()
            for s in batch:
                metrics.QUEUE_DURATION.labels(self.model).observe(start - s.enqueued_at)
            metrics.BATCH_SIZE.labels(self.model).observe(len(batch))
            metrics.BATCH_TOKENS.labels(self.model).observe(len(ids))
            self._busy[index] = True
            try:
                results = await loop.run_in_executor(pool, compute, ids, lengths)
            except Exception as exc:  # the engine maps it to an HTTP status
                for s in batch:
                    if not s.future.done():
                        s.future.set_exception(exc)
                continue
            finally:
                mark_ran(batch, index, start, len(ids))  # for the requests' traces
                self._busy[index] = False
                if self.queue or self.priority:
                    wakeup.set()
            metrics.INFERENCE_DURATION.labels(self.model).observe(time.perf_counter() - start)
            for s, r in zip(batch, results):
                if not s.future.done():
                    s.future.set_result(r)
