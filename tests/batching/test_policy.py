"""Batch formation: token and sequence budgets, at least one sequence, cancelled sequences dropped; bulk
work ages ahead of a stream of priority work."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest

from embed_service.batching.batcher import Batcher
from embed_service.batching.policy import PriorityFirst
from embed_service.batching.sequence import RequestState, Sequence

LOOP = asyncio.new_event_loop()  # futures need a loop; nothing runs on it


def seqs(lengths: list[int], state: RequestState | None = None) -> deque[Sequence]:
    loop = LOOP
    return deque(Sequence([0] * n, loop.create_future(), state or RequestState()) for n in lengths)


def test_fills_to_the_token_budget_in_arrival_order():
    q = seqs([10, 20, 30, 5])
    batch = PriorityFirst().take_lanes(deque(), q, max_tokens=60, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10, 20, 30]
    assert [len(s.ids) for s in q] == [5]


def test_sequence_budget():
    q = seqs([1] * 10)
    assert len(PriorityFirst().take_lanes(deque(), q, max_tokens=1000, max_seqs=4)) == 4 and len(q) == 6


def test_always_takes_one_even_past_the_budget():
    q = seqs([500, 1])
    assert [len(s.ids) for s in PriorityFirst().take_lanes(deque(), q, max_tokens=100, max_seqs=10)] == [500]


def test_cancelled_sequences_are_dropped_before_compute():
    gone = RequestState(cancelled=True)
    q = seqs([5, 5], gone) + seqs([7])
    batch = PriorityFirst().take_lanes(deque(), q, max_tokens=100, max_seqs=10)
    assert [len(s.ids) for s in batch] == [7] and not q


def test_priority_lane_goes_first_then_bulk_fills_the_next_budget():
    bulk = seqs([50, 50, 50])
    priority = seqs([5, 6])
    policy = PriorityFirst()
    batch = policy.take_lanes(priority, bulk, max_tokens=70, max_seqs=100)
    assert [len(s.ids) for s in batch] == [5, 6] and not policy.took_bulk
    batch = policy.take_lanes(priority, bulk, max_tokens=70, max_seqs=100)
    assert [len(s.ids) for s in batch] == [50] and policy.took_bulk
    assert [len(s.ids) for s in bulk] == [50, 50]


def test_a_full_priority_batch_leaves_bulk_waiting():
    bulk = seqs([1])
    priority = seqs([10, 10, 10])
    batch = PriorityFirst().take_lanes(priority, bulk, max_tokens=20, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10, 10]
    assert len(priority) == 1 and len(bulk) == 1


def test_priority_only_backends_and_cancelled_priority_sequences():
    gone = RequestState(cancelled=True)
    priority = seqs([3], gone) + seqs([4])
    bulk = seqs([9])
    batch = PriorityFirst().take_lanes(priority, None, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [4] and len(bulk) == 1


def test_a_batch_with_priority_work_takes_no_bulk_work():
    bulk = seqs([100] * 50)
    priority = seqs([12])
    batch = PriorityFirst().take_lanes(priority, bulk, max_tokens=16384, max_seqs=256)
    assert [len(s.ids) for s in batch] == [12] and len(bulk) == 50
    # Without priority work the full budget applies.
    batch = PriorityFirst().take_lanes(seqs([]), bulk, max_tokens=1000, max_seqs=256)
    assert len(batch) == 10


def test_a_bulk_lane_that_is_being_served_does_not_age_into_priority_batches():
    """Bulk work that waited past the aging bound because its queue is deep, while another replica computes
    bulk batches, is not starved: the short requests' batch stays short. Once nothing has served the bulk
    lane for the aging bound, it ages ahead as before."""
    policy = PriorityFirst(aging_s=1.0)
    bulk = seqs([30, 30])
    for s in bulk:
        s.enqueued_at = -100.0
    batch = policy.take_lanes(seqs([10]), bulk, max_tokens=100, max_seqs=100, bulk_running=True)
    assert [len(s.ids) for s in batch] == [10] and len(bulk) == 2
    policy.bulk_done()  # a bulk batch has just ended: served within the bound
    batch = policy.take_lanes(seqs([10]), bulk, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10] and len(bulk) == 2
    policy.bulk_served_at = time.perf_counter() - 2.0  # nothing served it for longer than the bound
    batch = policy.take_lanes(seqs([10]), bulk, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [30, 10] and len(bulk) == 1


def test_aged_bulk_work_goes_ahead_of_priority_work_in_half_a_batch():
    bulk = seqs([30, 30, 30, 30])
    for s in list(bulk)[:3]:
        s.enqueued_at = -100.0  # waited long past any aging bound
    priority = seqs([10] * 20)
    batch = PriorityFirst(aging_s=1.0).take_lanes(priority, bulk, max_tokens=100, max_seqs=100)
    # A second aged sequence would pass half the budget (2 x 60 > 100); priority work fills the rest.
    assert [len(s.ids) for s in batch] == [30] + [10] * 7
    assert len(bulk) == 3 and len(priority) == 13
    # Without aging the priority lane fills the batch and the bulk lane waits.
    bulk, priority = seqs([30]), seqs([10] * 20)
    bulk[0].enqueued_at = -100.0
    batch = PriorityFirst().take_lanes(priority, bulk, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10] * 10 and len(bulk) == 1


def test_an_aged_sequence_longer_than_half_the_budget_still_goes_alone():
    bulk = seqs([90])
    bulk[0].enqueued_at = -100.0
    batch = PriorityFirst(aging_s=1.0).take_lanes(seqs([10] * 5), bulk, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [90, 10]


def test_fresh_bulk_work_does_not_age():
    bulk = seqs([30])
    bulk[0].enqueued_at = time.perf_counter()
    batch = PriorityFirst(aging_s=60.0).take_lanes(seqs([10] * 10), bulk, max_tokens=100, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10] * 10 and len(bulk) == 1


@pytest.mark.parametrize("aging_s", [0.2, 0.0])
def test_bulk_work_completes_under_a_stream_of_short_requests(aging_s):
    """A stream that keeps the priority lane full for 300 batches (>= 1.5 s: each takes at least 5 ms): with
    aging the bulk request is answered during it; without, it waits for the stream to end (the starvation
    aging removes). The stream is counted in batches and refilled by each batch before its answer, so the
    lane never runs dry however slowly the machine runs (was: a 1.5 s loop refilling every 1 ms)."""
    stream_batches = 300
    batches = [0]

    async def main() -> int:
        loop = asyncio.get_running_loop()
        short: list[Sequence] = []

        def refill() -> None:  # on the loop, before the answer of the batch that asked for it
            if batches[0] < stream_batches and sum(not s.future.done() for s in short) < 50:
                more = [Sequence([0] * 10, loop.create_future(), RequestState()) for _ in range(20)]
                short.extend(more)
                batcher.submit(more, priority=True)

        def backend(ids, lengths, requests):
            # A batch's compute time, not a wait: the assertions count batches, whatever it lasts.
            time.sleep(0.005)
            batches[0] += 1
            loop.call_soon_threadsafe(refill)  # runs before the batcher learns this batch is done
            return list(lengths.tolist())

        batcher = Batcher([backend], 100, 100, "m", bulk_aging_s=aging_s)
        batcher.start()
        bulk = [Sequence([0] * 30, loop.create_future(), RequestState()) for _ in range(20)]
        batcher.submit(bulk)
        refill()
        await asyncio.gather(*(s.future for s in bulk))
        done_at = batches[0]
        await asyncio.gather(*(s.future for s in short))
        await batcher.stop()
        return done_at

    done_at = asyncio.run(main())
    print(
        f"\naging {aging_s} s: 20 bulk sequences answered after batch {done_at} of a {stream_batches}-batch stream"
    )
    if aging_s:
        assert done_at < stream_batches  # answered while the stream still ran
    else:
        assert done_at >= stream_batches  # only once it stopped
