"""The output cache on a re-indexing job: a corpus embedded, then embedded again with 30% of its passages
changed. Prints the re-index's hit ratio and its time against the same re-index without a cache.

    python -m benchmarks.cache_reindex --passages 150            # in process (--cache-bytes)
    python -m benchmarks.cache_reindex --passages 150 --redis    # a shared redis-server (--cache-url)

With --redis the corpus is indexed by one engine and re-indexed by a second one (another pod), so every
hit comes from Redis. --json PATH writes the figures, the machine and the load to a result file.
Figures: docs/performance.md ("The output cache on a re-index").
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from benchmarks.result_file import ResultFile
from embed_service import Embedder, metrics

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "passages.jsonl"


def corpus(n: int, changed: float, seed: int = 0) -> tuple[list[str], list[str]]:
    with open(CORPUS, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
    rng = random.Random(seed)
    edited = set(rng.sample(range(n), round(changed * n)))
    # The change at the start: a passage past the max input length still changes its token ids.
    return texts, [f"Revised: {t}" if i in edited else t for i, t in enumerate(texts)]


def redis_server() -> tuple[subprocess.Popen, str]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Ready to accept connections" in line:
            return proc, f"redis://127.0.0.1:{port}/0"
    raise SystemExit("redis-server did not start")


def timed(embedder: Embedder, texts: list[str]) -> float:
    t0 = time.perf_counter()
    embedder.encode(texts)
    return time.perf_counter() - t0


def counter(name: str) -> float:
    return sum(
        s.value
        for m in metrics.REGISTRY.collect()
        for s in m.samples
        if s.name == f"embed_cache_{name}_total"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passages", type=int, default=150)
    parser.add_argument("--changed", type=float, default=0.3)
    parser.add_argument("--redis", action="store_true")
    parser.add_argument("--json", help="write the figures to this result file")
    args = parser.parse_args()
    record = ResultFile()
    first, second = corpus(args.passages, args.changed)
    common = {"data_parallel_size": 1, "batch_invariant": True}
    with Embedder(**common) as plain:
        timed(plain, first[:64])  # warm
        base = timed(plain, second)
    if args.redis:
        proc, url = redis_server()
        try:
            with Embedder(**common, cache_url=url) as a:
                timed(a, first)
            hits, misses = counter("hits"), counter("misses")
            with Embedder(**common, cache_url=url) as b:
                timed(b, ["warm-up text"])
                cached = timed(b, second)
        finally:
            proc.kill()
    else:
        with Embedder(**common, cache_bytes=1 << 30) as c:
            timed(c, first)
            hits, misses = counter("hits"), counter("misses")
            cached = timed(c, second)
    hits, misses = counter("hits") - hits, counter("misses") - misses
    kind = "redis" if args.redis else "in process"
    print(
        f"{kind}: {args.passages} passages, {args.changed:.0%} changed: hit ratio {hits / (hits + misses):.1%}, "
        f"re-index {base:.2f} s without a cache, {cached:.2f} s with it ({base / cached:.2f}x)"
    )
    if args.json:
        figures = {
            "cache": "cache_url (redis-server)" if args.redis else "cache_bytes 1GiB",
            "passages": args.passages,
            "changed": args.changed,
            "hits": hits,
            "misses": misses,
            "hit_ratio": round(hits / (hits + misses), 4),
            "reindex_s_without_cache": round(base, 2),
            "reindex_s_with_cache": round(cached, 2),
            "speed_up": round(base / cached, 2),
        }
        record.write(args.json, figures)


if __name__ == "__main__":
    main()
