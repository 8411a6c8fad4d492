"""The queue owner. Callers append sequences and await their futures; the batcher forms batches with the
policy and runs the compute function: a coroutine function is awaited on the loop (the engine's: the
workers' pipes are written and read by the loop itself, workers/group.py), a plain one runs on a thread of
its backend, off the event loop.

Batches are formed when a compute backend is free (see policy.py for why); there is one backend per model
replica.

Every sequence handed to `submit` is answered exactly once (its own result, an error, or cancelled when its
request went away), whatever fails:
- a batch whose compute fails (an exception, or not one result per sequence) is retried once, on another
  backend that is up (embedding is idempotent); with no other backend up, or on the second failure, its
  sequences get the error;
- a compute function that raises `BackendLost` takes its backend out of service until `backend_up()` (the
  owner restarts it); while no backend is up, waiting and new sequences get that error at once;
- an error while forming a batch or handing out its results fails that batch's sequences, never the loop;
- `stop()` answers whatever is still waiting or running.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any

import numpy as np

from embed_service import metrics
from embed_service.batching.policy import PriorityFirst
from embed_service.batching.sequence import Sequence, mark_ran
from embed_service.outputs import OutputRequest

log = logging.getLogger(__name__)

# (flat token ids (T,) int32, lengths (B,) int32, one OutputRequest per sequence) -> one result per sequence;
# or a coroutine function returning the same.
ComputeFn = Callable[[np.ndarray, np.ndarray, list[OutputRequest]], list[Any] | Awaitable[list[Any]]]


class BackendLost(Exception):
    """Raised by a compute function whose backend is gone (dead or hung): the batcher sends it no batch until
    `backend_up()`. What it carries is what the sequences get when no other backend can take them."""


class ShortResultError(RuntimeError):
    """A backend returned a different number of results than its batch had sequences."""


class BatcherStopped(RuntimeError):
    """The batcher was stopped with sequences still waiting or running."""


class Batcher:
    """Two lanes (priority, bulk), a retry lane, and one run loop per compute backend (model replica).

    Every loop forms its batch when its backend is free: retried sequences first, then priority sequences,
    then bulk ones (policy.py). With two or more backends and `priority_batch_tokens` set, the last backend
    takes at most that many tokens of bulk work per batch while interactive traffic is about (a priority
    request in the last `PRIORITY_HOLD_S` seconds), so it is free again soon for the next short request.
    Without interactive
    traffic it takes up to IDLE_RESERVE_FACTOR times that: one 150-token passage per forward runs at about
    half the tokens/s of a full batch, while a few thousand tokens run nearly as fast per token and still
    bound the wait of the first short request to arrive.

    `lanes` (one compute function per backend, or None): each replica's priority lane, a second thread of
    its worker on the same weights (workers/worker.py). A lane takes priority sequences only, and only while
    its replica computes a batch that took bulk work, so a short request never waits for a bulk forward;
    no backend is then kept small (`priority_batch_tokens` is not needed). Backends `i` and
    `len(compute) + i` are then replica `i`'s main thread and lane: they go down and come back together, and
    a failed batch is retried on another replica. A lane's batches take at most `lane_batch_tokens` tokens
    (0: `max_batch_tokens`): the activations a worker holds beside its bulk batch.
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
        lanes: list[ComputeFn] | None = None,
        lane_batch_tokens: int = 0,
    ):
        mains = compute if isinstance(compute, list) else [compute]
        if lanes is not None and len(lanes) != len(mains):
            raise ValueError(f"{len(lanes)} priority lanes for {len(mains)} backends")
        self.backends = mains + (lanes or [])
        self._replica = [i % len(mains) for i in range(len(self.backends))]  # the replica each backend is
        self._is_lane = [i >= len(mains) for i in range(len(self.backends))]
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.policy = PriorityFirst(bulk_aging_s)
        self.queue: deque[Sequence] = deque()  # bulk lane
        self.priority: deque[Sequence] = deque()
        # Sequences of a failed batch, each with the error it gets if no other backend can take it.
        self.retry: deque[tuple[Sequence, BaseException]] = deque()
        self.model = model
        self.budgets = [max_batch_tokens] * len(self.backends)
        if priority_batch_tokens and len(mains) > 1 and lanes is None:
            self.budgets[len(mains) - 1] = min(priority_batch_tokens, max_batch_tokens)
        for j in range(len(mains), len(self.backends)):  # a lane's batch is the second one a worker holds
            self.budgets[j] = min(lane_batch_tokens or max_batch_tokens, max_batch_tokens)
        self._priority_seen = -float("inf")  # perf_counter() of the last priority submission
        self._wakeups = [asyncio.Event() for _ in self.backends]
        self._busy = [False] * len(self.backends)
        self._bulk_running = [False] * len(self.backends)  # computing a batch that took bulk work normally
        self._up = [True] * len(self.backends)
        self._down_error: BaseException | None = None  # what sequences get while no backend is up
        self._running: list[list[Sequence]] = [[] for _ in self.backends]
        # Every sequence submitted and not answered yet: what stop() answers, and what a failure while
        # forming a batch is checked against (the policy may have taken sequences out of the lanes).
        self._owned: set[Sequence] = set()
        self._prune_at = 4096
        self._stopped = False
        self._threads: list[ThreadPoolExecutor] = []
        self._tasks: list[asyncio.Task] = []
        # The metrics' children, looked up once: `labels()` validates and locks on every call.
        self._queue_gauge = metrics.QUEUE_SIZE.labels(model)
        self._queue_wait = metrics.QUEUE_DURATION.labels(model)
        self._batch_size = metrics.BATCH_SIZE.labels(model)
        self._batch_tokens = metrics.BATCH_TOKENS.labels(model)
        self._inference = metrics.INFERENCE_DURATION.labels(model)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run_loop(i)) for i in range(len(self.backends))]

    def submit(self, seqs: list[Sequence], priority: bool = False) -> None:
        if self._stopped or not any(self._up):
            exc = self._down_error if not self._stopped and self._down_error else BatcherStopped("stopped")
            for s in seqs:
                self._answer(s, error=exc)
            return
        now = time.perf_counter()
        for s in seqs:
            s.enqueued_at = now
        if priority:
            self._priority_seen = now
        (self.priority if priority else self.queue).extend(seqs)
        self._owned.update(seqs)
        if len(self._owned) > self._prune_at:
            self._prune()
        self._update_gauge()
        for j, wakeup in enumerate(self._wakeups):
            # A lane has work only beside its replica's bulk batch, and only priority work.
            if not self._is_lane[j] or (priority and self._bulk_running[self._replica[j]]):
                wakeup.set()

    def _update_gauge(self) -> None:
        self._queue_gauge.set(len(self.queue) + len(self.priority) + len(self.retry))

    def _prune(self) -> None:
        """Forget sequences whose request went away (the policy drops them from the lanes unanswered)."""
        for s in [s for s in self._owned if s.cancelled]:
            self._answer(s)
        self._prune_at = max(4096, 2 * len(self._owned))

    def _answer(self, s: Sequence, result: Any = None, error: BaseException | None = None) -> None:
        """The one place a sequence is answered. One whose request went away is cancelled instead: nobody
        would read an error set on it (asyncio would log it as never retrieved)."""
        self._owned.discard(s)
        if s.future.done():
            return
        if s.request.cancelled:
            s.future.cancel()
        elif error is not None:
            s.future.set_exception(error)
        else:
            s.future.set_result(result)

    def fail_all(self, exc: BaseException) -> None:
        """Answer every waiting sequence with an error (no backend can compute)."""
        for lane in (self.priority, self.queue):
            while lane:
                self._answer(lane.popleft(), error=exc)
        while self.retry:
            self._answer(self.retry.popleft()[0], error=exc)
        self._update_gauge()

    def _backends_of(self, replica: int) -> list[int]:
        return [j for j, r in enumerate(self._replica) if r == replica]

    def backend_down(self, index: int, exc: BaseException) -> None:
        """Send backend `index` (and the rest of its replica) no more batches until `backend_up(index)`;
        `exc` answers what waits in vain."""
        for j in self._backends_of(self._replica[index]):
            self._up[j] = False
        self._down_error = exc
        if not any(self._up):
            self.fail_all(exc)
            return
        self._fail_stranded_retries()

    def backend_up(self, index: int) -> None:
        for j in self._backends_of(self._replica[index]):
            self._up[j] = True
            self._wakeups[j].set()

    def _others_up(self, replica: int) -> bool:
        """Whether a replica other than `replica` is up."""
        return any(up for j, up in enumerate(self._up) if self._replica[j] != replica)

    def _fail_stranded_retries(self) -> None:
        """A retried sequence runs only on a backend other than the one that failed it; if none is up, it
        gets its error now rather than waiting for one."""
        keep: deque[tuple[Sequence, BaseException]] = deque()
        for s, exc in self.retry:
            if s.failed_on is not None and self._others_up(s.failed_on):
                keep.append((s, exc))
            else:
                self._answer(s, error=exc)
        self.retry = keep
        self._update_gauge()

    async def stop(self, exc: BaseException | None = None) -> None:
        """Stop the loops; every sequence still waiting or running gets `exc` (default: BatcherStopped)."""
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        error = exc or BatcherStopped(f"model {self.model} stopped with this input unanswered")
        self.priority.clear()
        self.queue.clear()
        self.retry.clear()
        for s in list(self._owned):
            self._answer(s, error=error)
        self._update_gauge()
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
        free = sum(
            1
            for j, (up, busy) in enumerate(zip(self._up, self._busy))
            if up and not busy and not self._is_lane[j]
        )
        if free <= 1:
            return budget
        waiting = sum(len(s.ids) for s in self.priority) + sum(len(s.ids) for s in self.queue)
        return max(1, min(budget, -(-waiting // free)))

    def _has_work(self, index: int) -> bool:
        if self._is_lane[index]:
            return bool(self.priority) and self._bulk_running[self._replica[index]]
        return bool(self.queue or self.priority or any(s.failed_on != index for s, _ in self.retry))

    def _take(self, index: int) -> list[Sequence]:
        if self._is_lane[index]:  # priority work only, beside its replica's bulk batch
            if not self._bulk_running[self._replica[index]]:
                return []
            return self.policy.take_lanes(self.priority, None, self.budgets[index], self.max_batch_requests)
        budget = self._share(self._budget(index))
        if self.retry:
            batch = self._take_retries(index, budget)
            if batch:
                return batch
        batch = self.policy.take_lanes(
            self.priority, self.queue, budget, self.max_batch_requests, any(self._bulk_running)
        )
        self._bulk_running[index] = self.policy.took_bulk
        return batch

    def _take_retries(self, index: int, budget: int) -> list[Sequence]:
        """Retried sequences first (they are the oldest work), never on the backend that failed them."""
        batch: list[Sequence] = []
        keep: deque[tuple[Sequence, BaseException]] = deque()
        tokens = 0
        for s, exc in self.retry:
            if s.cancelled:
                self._answer(s)
            elif s.failed_on == index or (
                batch and (tokens + len(s.ids) > budget or len(batch) >= self.max_batch_requests)
            ):
                keep.append((s, exc))
            else:
                batch.append(s)
                tokens += len(s.ids)
        self.retry = keep
        return batch

    async def _run_loop(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        compute, wakeup = self.backends[index], self._wakeups[index]
        on_loop = inspect.iscoroutinefunction(compute)
        pool = None
        if not on_loop:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{self.model}-{index}")
            self._threads.append(pool)
        while True:
            await wakeup.wait()
            if not self._up[index]:
                wakeup.clear()  # backend_up() sets it again
                continue
            batch: list[Sequence] = []
            try:
                batch = self._take(index)
                self._update_gauge()
                if not self._has_work(index):
                    wakeup.clear()
                if not batch:
                    continue
                lengths = np.fromiter((len(s.ids) for s in batch), dtype=np.int32, count=len(batch))
                ids = np.fromiter(
                    chain.from_iterable(s.ids for s in batch), dtype=np.int32, count=int(lengths.sum())
                )
                start = time.perf_counter()
                for s in batch:
                    self._queue_wait.observe(start - s.enqueued_at)
                self._batch_size.observe(len(batch))
                self._batch_tokens.observe(len(ids))
            except Exception as exc:  # a bug in forming the batch: answer what it held, keep serving
                log.exception("model %s: forming a batch failed", self.model)
                self._bulk_running[index] = False
                self._fail_taken(batch, exc)
                await asyncio.sleep(0)
                continue
            self._busy[index] = True
            self._running[index] = batch
            try:
                requests = [s.output for s in batch]
                if on_loop:
                    results = await compute(ids, lengths, requests)  # type: ignore[misc]
                else:
                    results = await loop.run_in_executor(pool, compute, ids, lengths, requests)
                if len(results) != len(batch):
                    raise ShortResultError(
                        f"replica {index} returned {len(results)} results for a batch of {len(batch)}"
                    )
            except Exception as exc:  # the engine maps it to an HTTP status
                if isinstance(exc, BackendLost):
                    self.backend_down(index, exc)
                self._retry_or_fail(index, batch, exc)
                continue
            finally:
                mark_ran(batch, self._replica[index], start, len(ids))  # for the requests' traces
                self._busy[index] = False
                self._running[index] = []
                if self._bulk_running[index]:
                    self._bulk_running[index] = False
                    self.policy.bulk_done()
                if self._has_work(index):
                    wakeup.set()
            try:
                self._inference.observe(time.perf_counter() - start)
                for s, r in zip(batch, results):
                    self._answer(s, r)
            except Exception as exc:
                log.exception("model %s: handing out a batch's results failed", self.model)
                for s in batch:
                    self._answer(s, error=exc)

    def _fail_taken(self, batch: Iterable[Sequence], exc: BaseException) -> None:
        """Answer the sequences of a batch that could not be formed, including any the policy took out of
        the lanes before it failed: every owned sequence that is neither waiting nor running."""
        placed = {*self.priority, *self.queue, *(s for s, _ in self.retry)}
        for running in self._running:
            placed.update(running)
        for s in {*batch, *(s for s in self._owned if s not in placed)}:
            self._answer(s, error=exc)
        self._update_gauge()

    def _retry_or_fail(self, index: int, batch: list[Sequence], exc: BaseException) -> None:
        retried = 0
        for s in batch:
            if s.cancelled:
                self._answer(s)
            elif s.failed_on is None and self._others_up(self._replica[index]):
                s.failed_on = self._replica[index]
                self.retry.append((s, exc))
                retried += 1
            else:
                self._answer(s, error=exc)
        if retried:
            log.warning(
                "model %s: a batch failed on replica %d (%s); retrying %d sequence(s) on another replica",
                self.model,
                self._replica[index],
                exc,
                retried,
            )
            self._update_gauge()
            for j, wakeup in enumerate(self._wakeups):
                if j != index:
                    wakeup.set()
