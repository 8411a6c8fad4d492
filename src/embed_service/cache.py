"""An exact cache of sequence outputs: the same token ids through the same model give the same bytes.

Exact because of batch invariance (ops/invariance.py): a sequence's outputs do not depend on what else
was in its batch, so a result computed once is the result of every later computation. What it stores is
a sequence's raw outputs (SequenceOutput: dense before normalization and ``dimensions``, sparse, ColBERT,
scores); what a request does with them afterwards (normalization, Matryoshka truncation, sparse top-k,
the encoding of the response) runs on a hit as on a miss, so the cache changes nothing a response says.

The key: the model's identity (a digest of its weight files and config, and the revision), everything
of the process that changes an output (dtype, device kind, tensor-parallel size), the OutputRequest (the
kinds asked for, where a pair's second text starts) and the token ids. LRU by bytes (``--cache-bytes``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from embed_service import metrics
from embed_service.config import Settings
from embed_service.models.spec import ModelSpec
from embed_service.ops import invariance
from embed_service.outputs import OutputRequest, SequenceOutput

# What an entry costs beside its arrays (the key, the dict slot, the objects): counted so that many tiny
# entries cannot hold far more memory than --cache-bytes says.
ENTRY_OVERHEAD = 200


def model_digest(path: Path, revision: str | None) -> str:
    """sha256 over the model folder's files that define its outputs (weights, configs, heads), by name and
    content, and the revision. Read once at start-up, only when a cache is configured."""
    h = hashlib.sha256(f"revision={revision}\0".encode())
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".json", ".gguf")
    )
    for p in files:
        h.update(str(p.relative_to(path)).encode() + b"\0")
        with p.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def output_bytes(out: SequenceOutput) -> int:
    arrays: list[np.ndarray | None] = [out.dense, out.colbert, out.score]
    if out.sparse is not None:
        arrays += [out.sparse.indices, out.sparse.values]
    return ENTRY_OVERHEAD + sum(a.nbytes for a in arrays if a is not None)


class OutputCache:
    """LRU by bytes over (identity, OutputRequest, token ids) -> SequenceOutput. Used from the event loop
    only (no lock)."""

    def __init__(self, max_bytes: int, identity: str, model: str):
        self.max_bytes = max_bytes
        self.prefix = hashlib.sha256(identity.encode()).digest()
        self.entries: OrderedDict[bytes, tuple[SequenceOutput, int]] = OrderedDict()
        self.bytes = 0
        self.hits = metrics.CACHE_HITS.labels(model)
        self.misses = metrics.CACHE_MISSES.labels(model)
        self.evictions = metrics.CACHE_EVICTIONS.labels(model)
        self.gauge = metrics.CACHE_BYTES.labels(model)

    def key(self, ids: list[int], request: OutputRequest) -> bytes:
        h = hashlib.sha256(self.prefix)
        h.update(",".join(sorted(request.kinds)).encode() + struct.pack("<q", request.second_segment))
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        return h.digest()

    def get(self, key: bytes) -> SequenceOutput | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses.inc()
            return None
        self.entries.move_to_end(key)
        self.hits.inc()
        return copy.deepcopy(entry[0])

    def put(self, key: bytes, out: SequenceOutput) -> None:
        size = output_bytes(out) + len(key)
        if size > self.max_bytes or key in self.entries:
            return
        self.entries[key] = (copy.deepcopy(out), size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped
            self.evictions.inc()
        self.gauge.set(self.bytes)

    def submit(
        self,
        ids: list[list[int]],
        requests: list[OutputRequest],
        compute: Callable[[list[list[int]], list[OutputRequest]], list[asyncio.Future]],
    ) -> list[asyncio.Future]:
        """Futures for every sequence: hits answered now, the misses through `compute` (the batcher),
        stored as they complete."""
        loop = asyncio.get_running_loop()
        keys = [self.key(i, r) for i, r in zip(ids, requests, strict=True)]
        futures: list[asyncio.Future] = []
        missed: list[int] = []
        for n, key in enumerate(keys):
            hit = self.get(key)
            f = loop.create_future()
            if hit is None:
                missed.append(n)
            else:
                f.set_result(hit)
            futures.append(f)
        if missed:
            computed = compute([ids[n] for n in missed], [requests[n] for n in missed])
            for n, f in zip(missed, computed, strict=True):
                f.add_done_callback(functools.partial(self._finish, key=keys[n], into=futures[n]))
        return futures

    def _finish(self, done: asyncio.Future, key: bytes, into: asyncio.Future) -> None:
        if into.done():
            return
        if done.cancelled():
            into.cancel()
        elif (exc := done.exception()) is not None:
            into.set_exception(exc)
        else:
            self.put(key, done.result())
            into.set_result(done.result())


def output_cache(settings: Settings, spec: ModelSpec, name: str, runs_as: str) -> OutputCache | None:
    """The model's output cache (--cache-bytes), which turns batch invariance on; None without one. Before
    any worker starts: they inherit the choice (ops/invariance.py)."""
    if settings.batch_invariant or settings.cache_bytes:
        invariance.set_enabled(True)
    if not settings.cache_bytes:
        return None
    identity = f"{model_digest(spec.path, settings.revision)}/{runs_as}/invariant"
    return OutputCache(settings.cache_bytes, identity, name)
