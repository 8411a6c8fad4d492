"""What every request kind's serving shares: `Run`, one request's sequences on the batcher from its permit
to its answer, and `EngineBase`, the engine's parts that the kinds use (engine/engine.py builds them)."""

from __future__ import annotations

import asyncio
from typing import Any

from embed_service import metrics, observability
from embed_service.batching.batcher import Batcher
from embed_service.batching.sequence import RequestState, Sequence
from embed_service.cache import OutputCache
from embed_service.engine.admission import Admission, Permit, check_request
from embed_service.engine.text import Inputs, TextSide
from embed_service.outputs import DENSE_ONLY, OutputRequest


class EngineBase(TextSide):
    """The parts of an `Engine` its request kinds (serving/embed.py, windowed.py, score.py) use: set up by
    `Engine.__init__` and its `start`."""

    admission: Admission
    batcher: Batcher | None
    cache: OutputCache | None

    def _admit(self, inputs: Inputs, prompt: str | None) -> Permit:
        """The one admission of every route: budgets (400), then capacity (429), before any tokenization."""
        check_request(inputs, prompt, self.limits)
        return self.admission.admit(len(inputs))


class Run:
    """One request's sequences on the batcher, from its permit to its answer: what embed, chunked embed and
    scoring share. A `with` block: leaving it on an error or a cancel drops what is still queued of the
    request (the client went away, or a batch failed), and the permit is closed either way."""

    def __init__(self, engine: EngineBase, permit: Permit, use_cache: bool = True):
        self.engine = engine
        self.permit = permit
        self.cache = engine.cache if use_cache else None
        self.state = RequestState()
        self.loop = asyncio.get_running_loop()
        self.tokens = 0
        self.submitted: list[Sequence] = []  # for the request's trace spans

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.state.cancelled = True
        self.permit.close()

    def submit(
        self, ids: list[list[int]], outputs: OutputRequest | list[OutputRequest] = DENSE_ONLY
    ) -> list[asyncio.Future[Any]]:
        """Queue a piece's sequences (`outputs`: for all, or one per sequence); their futures."""
        engine = self.engine
        if engine.state == "failed":  # a drain still finishes what it admitted; a dead worker cannot
            engine._check_ready()
        assert engine.batcher is not None
        each = outputs if isinstance(outputs, list) else [outputs] * len(ids)
        self.tokens += sum(map(len, ids))
        if self.cache is not None:  # hits answered now, the misses queued below (cache.py)
            return self.cache.submit(ids, each, self._queue)
        return self._queue(ids, each)

    def _queue(self, ids: list[list[int]], each: list[OutputRequest]) -> list[asyncio.Future[Any]]:
        engine = self.engine
        assert engine.batcher is not None
        seqs = [Sequence(i, self.loop.create_future(), self.state, o) for i, o in zip(ids, each, strict=True)]
        self.submitted.extend(seqs)
        # Interactive requests (admitted into the reserve) of few tokens take the priority lane;
        # see engine/admission.py and batching/policy.py.
        engine.batcher.submit(
            seqs, priority=self.permit.interactive and self.tokens <= engine.settings.priority_max_tokens
        )
        return [seq.future for seq in seqs]

    def answered(self) -> None:
        """Every sequence has its result: the request's trace spans and its token count."""
        observability.trace_batches(self.submitted)
        metrics.INPUT_TOKENS.labels(self.engine.name).inc(self.tokens)
