"""A replica's restart, when a step other than loading fails: closing the lost group, or building the new
one. Neither may leave the replica "restarting" forever: a close that fails is logged and the restart goes
on; a group that cannot be built counts as a failed restart (restarted again, then given up), as a group
that does not load does (tests/engine/test_replicas.py, whose stand-in groups these are)."""

from __future__ import annotations

import asyncio

from embed_service.engine.replicas import Replicas
from tests.engine.test_replicas import Group, Harness, settle


class CloseFails(Group):
    def close(self, timeout: float = 10.0) -> None:
        super().close(timeout)
        raise OSError("closing a pipe failed")


def test_a_close_that_raises_does_not_stop_the_restart():
    async def main():
        h = Harness(1)
        factory = h.replicas.make_group

        def make_group(index, on_death):
            group = factory(index, on_death)
            if len(h.groups) == 1:  # the first group's close fails
                group.__class__ = CloseFails
            return group

        h.replicas.make_group = make_group
        await h.replicas.start(lambda text: None)
        h.groups[0].die("worker 0 (pid 1000) was killed by SIGKILL")
        await settle(lambda: h.replicas.info()[0]["restarts"] == 1 and h.replicas.up == 1, timeout=10)
        await h.replicas.close()
        return h

    h = asyncio.run(main())
    assert h.replicas.info()[0]["state"] == "ready" and h.replicas.replicas[0].group is h.groups[1]
    assert not h.gave_up


def test_a_group_that_cannot_be_built_counts_as_a_failed_restart():
    async def main():
        h = Harness(1)
        factory = h.replicas.make_group

        def make_group(index, on_death):
            if h.groups:  # every group after the first
                raise OSError("no device for replica 0")
            return factory(index, on_death)

        h.replicas.make_group = make_group
        await h.replicas.start(lambda text: None)
        h.groups[0].die("worker 0 (pid 1000) was killed by SIGKILL")
        await settle(lambda: bool(h.gave_up), timeout=10)
        await h.replicas.close()
        return h

    h = asyncio.run(main())
    assert h.gave_up == [
        "replica 0: restart failed: no device for replica 0 "
        f"(after {Replicas.MAX_RESTARTS} restarts within 5 minutes)"
    ]
    assert h.replicas.info()[0]["state"] == "failed"
