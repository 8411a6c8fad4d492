"""How a batch is formed from the waiting sequences. The one place the batching policy lives.

The default policy (`PriorityFirst`):
- Two lanes. Sequences of small requests (interactive traffic, the engine decides which) wait in the
  priority lane; everything else in the bulk lane. A batch takes the priority lane first, oldest first,
  then fills up from the bulk lane, oldest first, until the next sequence would pass the token or
  sequence budget. A batch always takes at least one sequence, however long.
- Batches are formed at the moment compute is free, never ahead of time: a short request that arrives
  while a batch runs is in the very next batch, not behind one formed (frozen) before it came.
- Lengths are not packed here: the attention kernel groups the sequences of a batch by length itself
  (ops/attention.py), so arrival order can be kept and a request's inputs finish together.
"""

from __future__ import annotations

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


class PriorityFirst:
    """The priority lane first, then the bulk lane, each oldest first, within the budgets.

    A batch that carries priority sequences takes bulk work only up to `priority_fill_tokens` in all:
    a short request must not ride in (and wait for) a full-size bulk batch.
    """

    def take_lanes(
        self,
        priority: deque[Sequence],
        bulk: deque[Sequence] | None,
        max_tokens: int,
        max_seqs: int,
        priority_fill_tokens: int = 0,
    ) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens, full = fill(priority, batch, 0, max_tokens, max_seqs)
        if bulk is not None and not full:
            if batch and priority_fill_tokens:
                max_tokens = min(max_tokens, max(tokens, priority_fill_tokens))
            fill(bulk, batch, tokens, max_tokens, max_seqs)
        return batch
