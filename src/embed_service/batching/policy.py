"""How a batch is formed from the waiting sequences. The one place the batching policy lives."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from embed_service.batching.sequence import Sequence


class BatchPolicy(Protocol):
    def take(self, queue: deque[Sequence], max_tokens: int, max_seqs: int) -> list[Sequence]:
        """Remove and return the next batch; cancelled sequences are dropped on the way."""
        ...


class OldestFirst:
    """The longest-waiting sequences, until the next would pass the token or sequence budget.

    A batch always takes at least one sequence, however long.
    """

    def take(self, queue: deque[Sequence], max_tokens: int, max_seqs: int) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        while queue and len(batch) < max_seqs:
            seq = queue[0]
            if seq.cancelled:
                queue.popleft()
                continue
            if batch and tokens + len(seq.ids) > max_tokens:
                break
            queue.popleft()
            batch.append(seq)
            tokens += len(seq.ids)
        return batch
