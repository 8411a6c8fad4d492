"""One input of one request, as the batcher sees it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(eq=False)
class RequestState:
    """Shared by the sequences of one request: a client that goes away cancels them all."""

    cancelled: bool = False


@dataclass(eq=False)
class Sequence:
    ids: list[int]
    future: asyncio.Future
    request: RequestState
    enqueued_at: float = 0.0
    extra: dict = field(default_factory=dict)
    failed_on: int | None = None  # the backend whose batch failed it once; it is retried elsewhere, once

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled or self.future.done()
