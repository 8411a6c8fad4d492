"""Batch formation: token and sequence budgets, at least one sequence, cancelled sequences dropped."""

from __future__ import annotations

import asyncio
from collections import deque

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


def test_priority_lane_goes_first_then_bulk_fills_the_budget():
    bulk = seqs([50, 50, 50])
    priority = seqs([5, 6])
    batch = PriorityFirst().take_lanes(priority, bulk, max_tokens=70, max_seqs=100)
    assert [len(s.ids) for s in batch] == [5, 6, 50]
    assert not priority and [len(s.ids) for s in bulk] == [50, 50]


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


def test_a_batch_with_priority_work_takes_little_bulk_work():
    bulk = seqs([100] * 50)
    priority = seqs([12])
    batch = PriorityFirst().take_lanes(
        priority, bulk, max_tokens=16384, max_seqs=256, priority_fill_tokens=256
    )
    assert [len(s.ids) for s in batch] == [12, 100, 100]  # 212 tokens: the next 100 would pass 256
    assert len(bulk) == 48
    # Without priority work the full budget applies.
    batch = PriorityFirst().take_lanes(
        seqs([]), bulk, max_tokens=1000, max_seqs=256, priority_fill_tokens=256
    )
    assert len(batch) == 10
