"""One input of one request, as the batcher sees it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from embed_service.outputs import DENSE_ONLY, OutputRequest


@dataclass(eq=False)
class RequestState:
    """Shared by the sequences of one request: a client that goes away cancels them all."""

    cancelled: bool = False


@dataclass(frozen=True)
class BatchRun:
    """When (time.perf_counter() seconds) and where one batch ran; its sequences share one, which is how a
    request's trace learns its queue wait and inference time after the fact (observability.py)."""

    replica: int
    started_at: float
    finished_at: float
    sequences: int
    tokens: int


@dataclass(eq=False)
class Sequence:
    ids: list[int]
    future: asyncio.Future
    request: RequestState
    output: OutputRequest = DENSE_ONLY  # what the worker computes for it (outputs.py)
    enqueued_at: float = 0.0
    ran: BatchRun | None = None  # set when its batch has run (or failed)
    extra: dict = field(default_factory=dict)
    failed_on: int | None = None  # the backend whose batch failed it once; it is retried elsewhere, once

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled or self.future.done()


def mark_ran(batch: list[Sequence], replica: int, started_at: float, tokens: int) -> None:
    """Stamp a batch that has just ended (before its futures are answered)."""
    ran = BatchRun(replica, started_at, time.perf_counter(), len(batch), tokens)
    for s in batch:
        s.ran = ran
