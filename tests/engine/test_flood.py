"""A bounded flood at about twice the admission's capacity, on loopback, for 20 seconds: every answer is a
200 or a 429, and the server's resident memory stays bounded."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import psutil

from tests.server import ServerProcess

CAPACITY = 128  # inputs (--max-concurrent-requests)
CLIENTS = 16
FLOOD_S = 20.0
WARM_S = 3.0
# Resident bytes the flood may add, server and workers together. Measured on a 2-core AMD EPYC: +110 to
# +160 MiB over the 20 s, with or without the priority lane threads (--priority-max-tokens 0), nearly all
# in the two workers, whose allocators keep what a bulk batch and a lane batch freed; over 70 s of flood it
# levels off at about +100 MiB a worker.
GROWTH_BOUND = 256 * 2**20


def resident(proc: psutil.Process) -> int:
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


async def flood(url: str, seconds: float, statuses: Counter, outstanding: list[int]) -> None:
    rng = random.Random(0)
    words = [
        "an",
        "embedding",
        "service",
        "answers",
        "many",
        "callers",
        "at",
        "once",
        "without",
        "falling",
        "over",
    ]
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            # Mostly single queries, some batches: on average ~18 inputs per request, ~290 outstanding.
            n = rng.choices([1, 16, 64], weights=[5, 3, 2])[0]
            texts = [" ".join(rng.choices(words, k=rng.randint(3, 40))) for _ in range(n)]
            outstanding[0] += n
            try:
                r = await http.post(url + "/v1/embeddings", json={"input": texts})
                statuses[r.status_code] += 1
            finally:
                outstanding[0] -= n
            if r.status_code == 429:
                await asyncio.sleep(0.01)

    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))


def test_a_flood_at_twice_capacity_gets_only_200_and_429_in_bounded_memory():
    with ServerProcess(
        "--max-concurrent-requests", str(CAPACITY), "--interactive-reserved-inputs", str(CAPACITY // 4)
    ) as server:
        proc = psutil.Process(server.proc.pid)
        asyncio.run(flood(server.url, WARM_S, Counter(), [0]))  # allocators and caches settle
        before = resident(proc)
        statuses: Counter = Counter()
        outstanding = [0]
        peak = [0]

        async def run() -> None:
            async def watch() -> None:
                while True:
                    peak[0] = max(peak[0], resident(proc))
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch())
            try:
                await flood(server.url, FLOOD_S, statuses, outstanding)
            finally:
                watcher.cancel()

        t0 = time.perf_counter()
        asyncio.run(run())
        took = time.perf_counter() - t0
        after = resident(proc)
        print(
            f"\nflood {took:.0f} s, {CLIENTS} clients at ~2x {CAPACITY} inputs: statuses {dict(statuses)}; "
            f"resident {before / 2**20:.0f} MiB -> peak {peak[0] / 2**20:.0f} MiB, end {after / 2**20:.0f} MiB"
        )
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[200] > 0
        assert max(peak[0], after) - before < GROWTH_BOUND
        assert httpx.post(server.url + "/v1/embeddings", json={"input": "after"}).status_code == 200
