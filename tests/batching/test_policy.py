"""Batch formation: token and sequence budgets, at least one sequence, cancelled sequences dropped."""

from __future__ import annotations

import asyncio
from collections import deque

from embed_service.batching.policy import OldestFirst
from embed_service.batching.sequence import RequestState, Sequence

LOOP = asyncio.new_event_loop()  # futures need a loop; nothing runs on it


def seqs(lengths: list[int], state: RequestState | None = None) -> deque[Sequence]:
    loop = LOOP
    return deque(Sequence([0] * n, loop.create_future(), state or RequestState()) for n in lengths)


def test_fills_to_the_token_budget_in_arrival_order():
    q = seqs([10, 20, 30, 5])
    batch = OldestFirst().take(q, max_tokens=60, max_seqs=100)
    assert [len(s.ids) for s in batch] == [10, 20, 30]
    assert [len(s.ids) for s in q] == [5]


def test_sequence_budget():
    q = seqs([1] * 10)
    assert len(OldestFirst().take(q, max_tokens=1000, max_seqs=4)) == 4 and len(q) == 6


def test_always_takes_one_even_past_the_budget():
    q = seqs([500, 1])
    assert [len(s.ids) for s in OldestFirst().take(q, max_tokens=100, max_seqs=10)] == [500]


def test_cancelled_sequences_are_dropped_before_compute():
    gone = RequestState(cancelled=True)
    q = seqs([5, 5], gone) + seqs([7])
    batch = OldestFirst().take(q, max_tokens=100, max_seqs=10)
    assert [len(s.ids) for s in batch] == [7] and not q
