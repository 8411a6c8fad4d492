"""The batcher with several replicas: work is shared, the priority replica stays small, and a short
request goes into the next batch ahead of queued bulk work."""

from __future__ import annotations

import asyncio
import threading
import time

from embed_service.batching.batcher import Batcher
from embed_service.batching.sequence import RequestState, Sequence


class Backend:
    """A compute function that records the batches it ran (token counts per sequence)."""

    def __init__(self, seconds: float = 0.0):
        self.batches: list[list[int]] = []
        self.seconds = seconds
        self.lock = threading.Lock()

    def __call__(self, ids, lengths):
        time.sleep(self.seconds)
        with self.lock:
            self.batches.append(lengths.tolist())
        return [n for n in lengths.tolist()]


def run(coro):
    return asyncio.run(coro)


def make(loop, lengths):
    state = RequestState()
    return [Sequence([1] * n, loop.create_future(), state) for n in lengths]


def test_idle_replicas_share_the_waiting_work():
    a, b = Backend(0.05), Backend(0.05)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [16] * 128)
        batcher.submit(seqs)
        results = await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()
        return results

    assert run(main()) == [16] * 128
    assert a.batches and b.batches  # both replicas computed part of it


def test_the_priority_replica_takes_small_batches_while_interactive_traffic_is_about():
    a, b = Backend(0.01), Backend(0.01)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m", priority_batch_tokens=256)
        batcher.start()
        loop = asyncio.get_running_loop()
        short = make(loop, [5])
        batcher.submit(short, priority=True)
        await short[0].future
        seqs = make(loop, [200] * 40)
        batcher.submit(seqs)
        await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()

    run(main())
    assert all(sum(batch) <= 256 or len(batch) == 1 for batch in b.batches)
    assert max(sum(batch) for batch in a.batches) > 256


def test_without_interactive_traffic_the_reserved_replica_takes_larger_batches():
    a, b = Backend(0.05), Backend(0.05)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m", priority_batch_tokens=256)
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [200] * 40)
        batcher.submit(seqs)
        await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()

    run(main())
    assert b.batches and max(sum(batch) for batch in b.batches) > 256


def test_a_short_request_goes_ahead_of_queued_bulk_work():
    a = Backend(0.02)

    async def main():
        batcher = Batcher([a], 64, 256, "m")
        batcher.start()
        loop = asyncio.get_running_loop()
        bulk = make(loop, [64] * 10)
        batcher.submit(bulk)
        await asyncio.sleep(0.005)  # the first bulk batch is running
        short = make(loop, [7])
        batcher.submit(short, priority=True)
        await asyncio.gather(*(s.future for s in bulk + short))
        await batcher.stop()

    run(main())
    assert a.batches[1] == [7]  # the very next batch, before nine waiting bulk ones
