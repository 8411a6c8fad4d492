"""Self-healing replicas. Each replica of a model is one worker group (one process per tensor-parallel rank);
a replica that dies or hangs is killed and started again in this process, with back-off, while the others
keep serving.

- The group declares itself dead (workers/group.py: a worker exited, its heartbeat stopped, or a batch
  passed its deadline) and kills its processes; this supervisor takes the replica out of the batcher, whose
  failed batch is retried once on another replica (batching/batcher.py), so a crash under load loses no
  request while another replica is up.
- While no replica is up (a single replica restarting) the model answers 503 and /health says 503.
- A replica is restarted at most MAX_RESTARTS times within WINDOW_S; the next failure (a death, a hang or a
  restart that does not load) gives up: the model fails, and the server exits so the orchestrator, which
  can do more (another node, an alert), takes over.
- At tensor-parallel size > 1 the whole group restarts: a rank lost mid-collective leaves the others
  blocked in it, and a process group cannot take a new member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embed_service import metrics
from embed_service.batching.batcher import BackendLost, Batcher
from embed_service.engine.errors import DeviceMemoryError, NotReadyError
from embed_service.outputs import OutputRequest, SequenceOutput
from embed_service.workers.group import BatchOutOfMemoryError, WorkerDiedError, WorkerGroup

log = logging.getLogger(__name__)

# The batch deadline, when --batch-timeout is not set: this many times what the replica's warm-up measured
# per token of the longest inputs, times --max-batch-tokens, and never under the floor. On 2 busy cores the
# slowest 4,096-token batch of the default model (16 x 256 tokens, float32, both replicas computing) took
# 3.1 s and the warm-up estimated 1.2-3.1 s for it: the default deadline is 30 s there, ten times the worst
# batch. A hang detected late is still detected; a slow batch declared hung costs a replica for nothing.
BATCH_TIMEOUT_FACTOR = 10.0
BATCH_TIMEOUT_FLOOR_S = 30.0


def batch_deadline(max_batch_tokens: int, seconds_per_token: float, override: float | None = None) -> float:
    """Seconds a batch of up to `max_batch_tokens` tokens may take before its replica is declared hung."""
    if override:
        return override
    return max(BATCH_TIMEOUT_FLOOR_S, BATCH_TIMEOUT_FACTOR * seconds_per_token * max_batch_tokens)


class ReplicaLostError(NotReadyError, BackendLost):
    """A replica died or hung under a batch: the batcher retries the batch on another replica, and the
    sequences that cannot be retried are answered 503."""


@dataclass(eq=False)
class Replica:
    """One replica as the supervisor sees it."""

    index: int
    group: WorkerGroup
    state: str = "starting"  # starting -> ready -> restarting -> ready ... | failed
    restarts: int = 0
    last_failure: str | None = None
    failures: deque[float] = field(default_factory=deque)  # time.monotonic() of failures in the window
    task: asyncio.Task | None = None  # the restart in progress
    devices: tuple[str, ...] = ()  # one per rank, from the resource plan (plan.py)

    def info(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "state": self.state,
            "restarts": self.restarts,
            "pids": [r["pid"] for r in self.group.rank_info] if self.state == "ready" else [],
            "devices": list(self.devices),
            "last_failure": self.last_failure,
        }


GroupFactory = Callable[[int, Callable[[str], None]], WorkerGroup]


class Replicas:
    """Starts the replicas of one model, computes on them, and restarts the ones that fail.

    `make_group(index, on_death)` builds a (not yet started) group, on replica `index`'s own devices
    (`devices[index]`, the resource plan's: a restarted replica gets the same ones); `on_change(replicas_up,
    reason)` runs on the event loop whenever a replica goes down or comes back; `on_give_up(reason)` once,
    when restarts keep failing.
    """

    MAX_RESTARTS = 3
    WINDOW_S = 300.0
    BACKOFF_S = 0.5  # before the first restart in the window; doubled for each further one

    def __init__(
        self,
        model: str,
        count: int,
        make_group: GroupFactory,
        max_batch_tokens: int,
        batch_timeout: float | None,
        on_change: Callable[[int, str | None], None],
        on_give_up: Callable[[str], None],
        devices: tuple[tuple[str, ...], ...] = (),
    ):
        self.model = model
        self.count = count
        self.devices = devices
        self.make_group = make_group
        self.max_batch_tokens = max_batch_tokens
        self.batch_timeout = batch_timeout
        self.on_change = on_change
        self.on_give_up = on_give_up
        self.replicas: list[Replica] = []
        self.batcher: Batcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._ready_gauge = metrics.REPLICAS_READY.labels(model)

    def _new_group(self, index: int) -> WorkerGroup:
        def on_death(reason: str) -> None:  # on the group's watcher (or compute) thread
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._lost, index, group, reason)

        group = self.make_group(index, on_death)
        return group

    async def start(self, on_log: Callable[[str], None]) -> None:
        """Start every replica and wait until all have loaded and warmed up; raise if one cannot."""
        self._loop = asyncio.get_running_loop()
        self.replicas = [
            Replica(i, self._new_group(i), devices=self.devices[i] if self.devices else ())
            for i in range(self.count)
        ]
        # On the event loop's thread: each worker is killed by the kernel when the thread that started it
        # ends (PR_SET_PDEATHSIG), and this thread lives as long as the server.
        for r in self.replicas:
            r.group.start()
        for r in self.replicas:
            await asyncio.to_thread(r.group.wait_ready, on_log if r.index == 0 else (lambda text: None))
            self._set_ready(r)
        self._ready_gauge.set(self.up)

    def _set_ready(self, r: Replica) -> None:
        per_token = max(info.get("warmup_seconds_per_token", 0.0) for info in r.group.rank_info)
        r.group.batch_timeout = batch_deadline(self.max_batch_tokens, per_token, self.batch_timeout)
        r.state = "ready"

    @property
    def up(self) -> int:
        return sum(r.state == "ready" for r in self.replicas)

    @property
    def batch_timeouts(self) -> list[float | None]:
        return [r.group.batch_timeout for r in self.replicas]

    def compute(
        self,
        index: int,
        ids: np.ndarray,
        lengths: np.ndarray,
        requests: list[OutputRequest],
        lane: bool = False,
    ) -> list[SequenceOutput]:
        """Run one batch on replica `index` (blocking; on a thread); `lane`: on its priority lane."""
        with self._served_errors():
            return self.replicas[index].group.run(ids, lengths, requests, lane)

    async def compute_async(
        self,
        index: int,
        ids: np.ndarray,
        lengths: np.ndarray,
        requests: list[OutputRequest],
        lane: bool = False,
    ) -> list[SequenceOutput]:
        """`compute`, from the event loop (workers/group.py `run_async`): what the batcher calls."""
        with self._served_errors():
            return await self.replicas[index].group.run_async(ids, lengths, requests, lane)

    @contextlib.contextmanager
    def _served_errors(self) -> Iterator[None]:
        """A group's errors as the engine serves them: a lost replica, or a batch the device cannot hold."""
        try:
            yield
        except WorkerDiedError as exc:
            raise ReplicaLostError(f"model {self.model} is unavailable: {exc}") from None
        except BatchOutOfMemoryError as exc:
            raise DeviceMemoryError(
                f"model {self.model}: {exc}; send shorter inputs, or serve with a smaller --max-input-length"
            ) from None

    def _lost(self, index: int, group: WorkerGroup, reason: str) -> None:
        r = self.replicas[index]
        if r.group is not group or r.state != "ready" or self._closing:
            return  # a stale report (an old group's), or a second one
        self._failed(r, reason)

    def _failed(self, r: Replica, reason: str) -> None:
        now = time.monotonic()
        r.last_failure = reason
        r.failures.append(now)
        while now - r.failures[0] > self.WINDOW_S:
            r.failures.popleft()
        if self.batcher is not None:
            self.batcher.backend_down(
                r.index, ReplicaLostError(f"model {self.model} is unavailable: {reason}; restarting")
            )
        if len(r.failures) > self.MAX_RESTARTS:
            r.state = "failed"
            self._changed(reason)
            self.on_give_up(
                f"replica {r.index}: {reason} (after {self.MAX_RESTARTS} restarts within "
                f"{self.WINDOW_S / 60:.0f} minutes)"
            )
            return
        r.state = "restarting"
        delay = self.BACKOFF_S * 2 ** (len(r.failures) - 1)
        log.warning(
            "model %s: replica %d lost: %s; restarting it in %.1fs (%d of at most %d restarts in %.0f min)",
            self.model,
            r.index,
            reason,
            delay,
            len(r.failures),
            self.MAX_RESTARTS,
            self.WINDOW_S / 60,
        )
        self._changed(reason)
        r.task = asyncio.create_task(self._restart(r, delay))

    async def _restart(self, r: Replica, delay: float) -> None:
        await asyncio.sleep(delay)
        try:  # killed already; reap it and close its pipes. Its processes are gone either way: go on.
            await asyncio.to_thread(r.group.close, 1.0)
        except Exception as exc:
            log.warning("model %s: replica %d: closing the lost workers failed: %r", self.model, r.index, exc)
        if self._closing:
            return
        t0 = time.perf_counter()
        try:  # whatever fails from here, the replica is failed again (restarted or given up), never stuck
            r.group = self._new_group(r.index)
            r.restarts += 1
            metrics.REPLICA_RESTARTS.labels(self.model).inc()
            r.group.start()
            await asyncio.to_thread(r.group.wait_ready, lambda text: None)
        except Exception as exc:  # not built, not started, or did not load (a worker died or failed)
            if self._closing:
                return
            log.error("model %s: replica %d did not restart: %s", self.model, r.index, exc)
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
            # The first line says what failed, the last one why (a traceback's exception line).
            self._failed(r, "restart failed: " + (lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"))
            return
        if self._closing:
            return
        self._set_ready(r)
        log.info(
            "model %s: replica %d back in %.1fs (worker pids %s)",
            self.model,
            r.index,
            time.perf_counter() - t0,
            ", ".join(str(p) for p in r.group.pids),
        )
        if self.batcher is not None:
            self.batcher.backend_up(r.index)
        self._changed(None)

    def _changed(self, reason: str | None) -> None:
        self._ready_gauge.set(self.up)
        self.on_change(self.up, reason)

    async def close(self) -> None:
        self._closing = True
        tasks = [r.task for r in self.replicas if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(r.group.close) for r in self.replicas))

    def info(self) -> list[dict[str, Any]]:
        return [r.info() for r in self.replicas]
