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
import io
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from embed_service import metrics
from embed_service.config import Settings
from embed_service.models.spec import ModelSpec
from embed_service.ops import invariance
from embed_service.outputs import OutputRequest, SequenceOutput, Sparse

log = logging.getLogger(__name__)

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
    arrays: list[np.ndarray | None] = [out.dense, out.colbert, out.score, out.tokens]
    if out.sparse is not None:
        arrays += [out.sparse.indices, out.sparse.values]
    return ENTRY_OVERHEAD + sum(a.nbytes for a in arrays if a is not None)


class OutputCache:
    """LRU by bytes over (identity, OutputRequest, token ids) -> SequenceOutput, in front of a shared Redis
    when one is given. Used from the event loop only (no lock)."""

    def __init__(self, max_bytes: int, identity: str, model: str, redis_url: str | None = None):
        self.max_bytes = max_bytes
        self.prefix = hashlib.sha256(identity.encode()).digest()
        self.entries: OrderedDict[bytes, tuple[SequenceOutput, int]] = OrderedDict()
        self.bytes = 0
        self.redis = RedisTier(redis_url, model) if redis_url else None
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
        """The in-process entry (a copy), or None; counts nothing."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
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
        """Futures for every sequence: in-process hits answered now; the rest looked up in Redis (when
        there is one) and what it lacks through `compute` (the batcher), stored as they complete."""
        loop = asyncio.get_running_loop()
        keys = [self.key(i, r) for i, r in zip(ids, requests, strict=True)]
        futures = [loop.create_future() for _ in keys]
        missed: list[int] = []
        for n, key in enumerate(keys):
            hit = self.get(key)
            if hit is None:
                missed.append(n)
            else:
                self.hits.inc()
                futures[n].set_result(hit)
        if not missed:
            return futures

        def run(todo: list[int]) -> None:
            self.misses.inc(len(todo))
            if not todo:
                return
            computed = compute([ids[n] for n in todo], [requests[n] for n in todo])
            for n, f in zip(todo, computed, strict=True):
                f.add_done_callback(functools.partial(self._finish, key=keys[n], into=futures[n]))

        if self.redis is None:
            run(missed)
        else:
            task = loop.create_task(self._from_redis(keys, missed, futures, run))
            for f in futures:  # the request cancelled while Redis answers: the lookup goes too
                f.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        return futures

    async def _from_redis(
        self,
        keys: list[bytes],
        missed: list[int],
        futures: list[asyncio.Future],
        run: Callable[[list[int]], None],
    ) -> None:
        assert self.redis is not None
        try:
            found = await self.redis.get_many([keys[n] for n in missed])
        except BaseException as exc:  # run() must still answer every future
            if not isinstance(exc, Exception):
                raise
            found = [None] * len(missed)
        todo = []
        for n, out in zip(missed, found, strict=True):
            if out is None:
                todo.append(n)
            elif not futures[n].done():
                self.hits.inc()
                self.put(keys[n], out)
                futures[n].set_result(out)
        try:
            run(todo)
        except Exception as exc:  # the engine failing or stopping: the request's futures carry it
            for n in todo:
                if not futures[n].done():
                    futures[n].set_exception(exc)

    def _finish(self, done: asyncio.Future, key: bytes, into: asyncio.Future) -> None:
        if done.cancelled():
            if not into.done():
                into.cancel()
            return
        if (exc := done.exception()) is not None:
            if not into.done():
                into.set_exception(exc)
            return
        out = done.result()
        self.put(key, out)
        if self.redis is not None:
            self.redis.put_later(key, out)
        if not into.done():
            into.set_result(out)


class RedisTier:
    """The shared tier: one Redis for every replica and pod, values in the safe format of ``pack``. Any
    Redis error counts in embed_cache_redis_errors_total and reads as a miss (a lookup) or is dropped (a
    store): an outage degrades to computing, never to a failed request."""

    TIMEOUT_S = 0.5
    PREFIX = b"embed-service:v1:"

    def __init__(self, url: str, model: str):
        import redis.asyncio

        self.client = redis.asyncio.from_url(
            url, socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S
        )
        self.errors = metrics.CACHE_REDIS_ERRORS.labels(model)
        self.pending: set[asyncio.Task] = set()

    async def get_many(self, keys: list[bytes]) -> list[SequenceOutput | None]:
        try:
            values = await self.client.mget([self.PREFIX + k for k in keys])
            return [None if v is None else unpack(v if isinstance(v, bytes) else v.encode()) for v in values]
        except Exception:
            self.errors.inc()
            log.warning("the Redis cache failed a lookup; computing instead", exc_info=True)
            return [None] * len(keys)

    def put_later(self, key: bytes, out: SequenceOutput) -> None:
        task = asyncio.get_running_loop().create_task(self._put(key, pack(out)))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _put(self, key: bytes, value: bytes) -> None:
        try:
            await self.client.set(self.PREFIX + key, value)
        except Exception:
            self.errors.inc()
            log.warning("the Redis cache failed a store", exc_info=True)


_SLOTS = ("dense", "colbert", "score", "sparse_indices", "sparse_values", "tokens")


def pack(out: SequenceOutput) -> bytes:
    """A SequenceOutput as bytes: per slot a length (0: absent) and the array in .npy format (no pickles:
    a shared Redis must not be able to run code in the server)."""
    arrays = [out.dense, out.colbert, out.score]
    arrays += [None, None] if out.sparse is None else [out.sparse.indices, out.sparse.values]
    arrays.append(out.tokens)
    parts = []
    for a in arrays:
        data = b""
        if a is not None:
            buf = io.BytesIO()
            np.save(buf, a, allow_pickle=False)
            data = buf.getvalue()
        parts.append(struct.pack("<Q", len(data)) + data)
    return b"".join(parts)


def unpack(value: bytes) -> SequenceOutput:
    arrays: list[np.ndarray | None] = []
    at = 0
    for _ in _SLOTS:
        if at == len(value):  # stored before the slot existed (a shared Redis outlives a server)
            arrays.append(None)
            continue
        (n,) = struct.unpack_from("<Q", value, at)
        at += 8
        arrays.append(np.load(io.BytesIO(value[at : at + n]), allow_pickle=False) if n else None)
        at += n
    out = SequenceOutput()
    out.dense, out.colbert, out.score = arrays[0], arrays[1], arrays[2]
    if arrays[3] is not None and arrays[4] is not None:
        out.sparse = Sparse(arrays[3], arrays[4])
    out.tokens = arrays[5]
    return out


def output_cache(settings: Settings, spec: ModelSpec, name: str, runs_as: str) -> OutputCache | None:
    """The model's output cache (--cache-bytes), which turns batch invariance on; None without one. Before
    any worker starts: they inherit the choice (ops/invariance.py)."""
    if settings.batch_invariant or settings.cache_bytes or settings.cache_url:
        invariance.set_enabled(True)
    if not (settings.cache_bytes or settings.cache_url):
        return None
    identity = f"{model_digest(spec.path, settings.revision)}/{runs_as}/invariant"
    return OutputCache(settings.cache_bytes, identity, name, settings.cache_url)
