"""The replica supervisor on its own, over stand-in worker groups: a replica that dies is restarted while the
others serve, restarts back off, a report from an old group is ignored, and restarts that keep failing
give up once (the server then exits; tests/test_lifecycle.py shows it on a live server)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from embed_service.engine.replicas import ReplicaLostError, Replicas, batch_deadline
from embed_service.outputs import DENSE_ONLY
from embed_service.workers.group import WorkerDiedError

PIDS = itertools.count(1000)


class Group:
    """What the supervisor uses of a WorkerGroup. `loads` says whether starting it succeeds."""

    def __init__(self, index: int, on_death, loads: bool = True):
        self.index, self.on_death, self.loads = index, on_death, loads
        self.batch_timeout: float | None = None
        self.rank_info: list[dict] = []
        self.pids: list[int] = []
        self.closed = False
        self.dead: str | None = None

    def start(self) -> None:
        self.pids = [next(PIDS)]

    def wait_ready(self, on_log) -> None:
        if not self.loads:
            raise WorkerDiedError("worker 0 failed while loading:\nOSError: no weights")
        self.rank_info = [{"pid": self.pids[0], "warmup_seconds_per_token": 1e-4}]

    def run(self, ids, lengths, requests, lane=False):
        if self.dead:
            raise WorkerDiedError(self.dead)
        return np.zeros((len(lengths), 4), dtype=np.float32)

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def die(self, reason: str) -> None:  # what the watcher thread does
        self.dead = reason
        self.on_death(reason)


class Batcher:
    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def backend_down(self, index: int, exc: BaseException) -> None:
        self.events.append(("down", index))

    def backend_up(self, index: int) -> None:
        self.events.append(("up", index))


class Harness:
    def __init__(self, count: int, loads=lambda n: True):
        self.groups: list[Group] = []
        self.changes: list[tuple[int, str | None]] = []
        self.gave_up: list[str] = []
        self.loads = loads

        def make_group(index: int, on_death) -> Group:
            group = Group(index, on_death, self.loads(len(self.groups)))
            self.groups.append(group)
            return group

        self.replicas = Replicas(
            "m",
            count,
            make_group,
            4096,
            None,
            on_change=lambda up, reason: self.changes.append((up, reason)),
            on_give_up=self.gave_up.append,
        )
        self.replicas.BACKOFF_S = 0.01
        self.batcher = Batcher()
        self.replicas.batcher = self.batcher  # type: ignore[assignment]


async def settle(condition, timeout: float = 60.0) -> None:
    """Wait for the state `condition` names; `timeout` is a failure bound only."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_dead_replica_is_restarted_while_the_other_serves():
    async def main():
        h = Harness(2)
        await h.replicas.start(lambda text: None)
        first = h.groups[0]
        first.die("worker 0 (pid 1000) was killed by SIGKILL")
        with pytest.raises(ReplicaLostError, match="killed by SIGKILL"):
            h.replicas.compute(0, np.ones(4, dtype=np.int32), np.array([4], dtype=np.int32), [DENSE_ONLY])
        await settle(lambda: h.replicas.up == 1)
        assert h.changes[-1] == (1, "worker 0 (pid 1000) was killed by SIGKILL")
        await settle(lambda: h.replicas.up == 2)
        assert first.closed and h.replicas.replicas[0].group is h.groups[2]
        assert h.batcher.events == [("down", 0), ("up", 0)]
        info = h.replicas.info()[0]
        assert info["state"] == "ready" and info["restarts"] == 1 and info["pids"] == h.groups[2].pids
        first.die("a second report from the old group")  # ignored: that group is gone
        # Nothing must happen, which no event marks: wait five times the backoff a restart would take.
        await asyncio.sleep(5 * h.replicas.BACKOFF_S)
        assert h.replicas.up == 2 and len(h.groups) == 3
        await h.replicas.close()
        return h

    h = asyncio.run(main())
    assert not h.gave_up
    assert all(g.closed for g in h.groups)


def test_restarts_that_keep_failing_give_up_once():
    async def main():
        h = Harness(1, loads=lambda n: n == 0)  # only the first start loads
        await h.replicas.start(lambda text: None)
        h.groups[0].die("worker 0 (pid 1000) was killed by SIGKILL")
        await settle(lambda: bool(h.gave_up))
        # No further restart must come, which no event marks: five times the backoff one would take.
        await asyncio.sleep(5 * h.replicas.BACKOFF_S)
        await h.replicas.close()
        return h

    h = asyncio.run(main())
    assert len(h.groups) == 1 + Replicas.MAX_RESTARTS  # the first start, then three restarts
    assert h.gave_up == [
        "replica 0: restart failed: worker 0 failed while loading: OSError: no weights "
        "(after 3 restarts within 5 minutes)"
    ]
    assert h.replicas.info()[0]["state"] == "failed"
    assert h.changes[0] == (0, "worker 0 (pid 1000) was killed by SIGKILL")


def test_the_batch_deadline_scales_with_the_batch_budget_and_has_a_floor():
    assert batch_deadline(4096, 1e-4) == 30.0  # 10 x 0.41 s is under the floor
    assert batch_deadline(65536, 1e-3) == pytest.approx(655.36)
    assert batch_deadline(4096, 1e-3, override=2.5) == 2.5
