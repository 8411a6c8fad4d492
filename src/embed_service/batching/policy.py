"""How a batch is formed from the waiting sequences. The one place the batching policy lives.

The default policy (`PriorityFirst`):
- Two lanes. Sequences of small requests (interactive traffic, the engine decides which) wait in the
  priority lane; everything else in the bulk lane. A batch takes the priority lane first, oldest first; a
  batch without priority work takes the bulk lane, oldest first, until the next sequence would pass the
  token or sequence budget. A batch always takes at least one sequence, however long. A batch that carries
  priority work takes no (unaged) bulk work: a short request's batch is as short as it is, not a bulk
  sequence's forward with it riding along.
- Batches are formed at the moment compute is free, never ahead of time: a short request that arrives
  while a batch runs is in the very next batch, not behind one formed (frozen) before it came.
- Aging: while the bulk lane is starved (no batch has taken bulk work the normal way, and none that did is
  running, for `aging_s`) a bulk sequence that has waited longer than `aging_s` goes ahead of the priority
  lane, in up to half of the batch's tokens (at least one sequence), so bulk work cannot starve behind a
  stream of short requests, and short requests still get at least the other half of every batch. A bulk
  lane that is being served (another replica computes bulk batches) is not starved however deep its queue,
  so its long waits do not put bulk work into the short requests' batches.
- Lengths are not packed here: the attention kernel groups the sequences of a batch by length itself
  (ops/attention.py), so arrival order can be kept and a request's inputs finish together.
"""

from __future__ import annotations

import time
from collections import deque

from embed_service.batching.sequence import Sequence


def fill(
    queue: deque[Sequence], batch: list[Sequence], tokens: int, max_tokens: int, max_seqs: int
) -> tuple[int, bool]:
    """Move sequences from the head of `queue` into `batch` while they fit. Returns (tokens in the batch,
    whether the batch is full: the next sequence did not fit)."""
    while queue and len(batch) < max_seqs:
        seq = queue[0]
        if seq.cancelled:
            queue.popleft()
            continue
        if batch and tokens + len(seq.ids) > max_tokens:
            return tokens, True
        queue.popleft()
        batch.append(seq)
        tokens += len(seq.ids)
    return tokens, len(batch) >= max_seqs


def fill_aged(
    queue: deque[Sequence], batch: list[Sequence], max_tokens: int, max_seqs: int, aged_before: float
) -> int:
    """Move the sequences enqueued before `aged_before` (the bulk lane is oldest first) into the empty
    `batch`, within half of `max_tokens` (at least one). Returns the tokens taken."""
    tokens = 0
    while queue and len(batch) < max_seqs:
        seq = queue[0]
        if seq.cancelled:
            queue.popleft()
            continue
        if seq.enqueued_at > aged_before or (batch and 2 * (tokens + len(seq.ids)) > max_tokens):
            break
        queue.popleft()
        batch.append(seq)
        tokens += len(seq.ids)
    return tokens


class PriorityFirst:
    """Aged bulk work while the bulk lane starves, then the priority lane, then (in batches without priority
    work) the bulk lane, each oldest first, within the budgets.

    `took_bulk` says whether the last batch took bulk work the normal way; the batcher calls `bulk_done()`
    when such a batch ends, and says with `bulk_running` whether one is running.
    """

    def __init__(self, aging_s: float = 0.0):
        self.aging_s = aging_s
        self.bulk_served_at = -float("inf")  # perf_counter() of the last normal bulk take or its batch's end
        self.took_bulk = False

    def bulk_done(self) -> None:
        self.bulk_served_at = time.perf_counter()

    def take_lanes(
        self,
        priority: deque[Sequence],
        bulk: deque[Sequence] | None,
        max_tokens: int,
        max_seqs: int,
        bulk_running: bool = False,
    ) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        self.took_bulk = False
        now = time.perf_counter()
        starved = not bulk_running and now - self.bulk_served_at > self.aging_s
        if bulk is not None and self.aging_s > 0 and priority and starved:
            tokens = fill_aged(bulk, batch, max_tokens, max_seqs, now - self.aging_s)
        aged = len(batch)
        tokens, full = fill(priority, batch, tokens, max_tokens, max_seqs)
        if bulk is not None and not full and len(batch) == aged:
            fill(bulk, batch, tokens, max_tokens, max_seqs)
            if len(batch) > aged:
                self.took_bulk = True
                self.bulk_served_at = now
        return batch
