"""The exact output cache (--cache-bytes, --cache-url): a warm run of a corpus answers the same bytes as the
cold run, a request can opt out, the options applied after the model (normalization, dimensions) work on
hits as on misses, servers share a real redis-server, and its outage degrades to computing. Real servers
on loopback with the packaged model in its default dtype."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from embed_service.cache import OutputCache, pack, unpack
from embed_service.outputs import DENSE_ONLY, SequenceOutput, Sparse
from tests.server import ServerProcess, free_port, read_corpus


@pytest.fixture(scope="module")
def cached() -> Iterator[ServerProcess]:
    with ServerProcess("--cache-bytes", "20000000", "--data-parallel-size", "2") as server:
        yield server


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def embed(url: str, inputs, **extra) -> dict:
    body = {"input": inputs, "encoding_format": "base64", **extra}
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_warm_run_answers_the_bytes_of_the_cold_run(cached):
    corpus = read_corpus("passages.jsonl", 48) + read_corpus("queries.jsonl", 16)
    hits, misses = (
        metric(cached.url, "embed_cache_hits_total"),
        metric(cached.url, "embed_cache_misses_total"),
    )
    cold = embed(cached.url, corpus)
    assert metric(cached.url, "embed_cache_misses_total") - misses == len(corpus)
    # Warm, in other batches: one text per request, in reverse order, and the whole corpus again.
    singles = [embed(cached.url, [t])["data"][0]["embedding"] for t in reversed(corpus)]
    warm = embed(cached.url, corpus)
    assert warm == cold  # the whole response: vectors, usage, model
    assert singles[::-1] == [d["embedding"] for d in cold["data"]]
    assert metric(cached.url, "embed_cache_hits_total") - hits == 2 * len(corpus)
    assert metric(cached.url, "embed_cache_bytes") > 0


def test_a_request_that_opts_out_computes_and_gets_the_same_bytes(cached):
    texts = read_corpus("queries.jsonl", 8)
    embed(cached.url, texts)  # now cached
    hits = metric(cached.url, "embed_cache_hits_total")
    computed = embed(cached.url, texts, cache=False)
    assert metric(cached.url, "embed_cache_hits_total") == hits
    assert computed == embed(cached.url, texts)


def test_options_after_the_model_apply_to_hits_as_to_misses(cached):
    texts = read_corpus("passages.jsonl", 6)
    embed(cached.url, texts)
    for extra in ({"dimensions": 64}, {"normalize": False}, {"embed_dtype": "int8"}):
        assert embed(cached.url, texts, **extra) == embed(cached.url, texts, cache=False, **extra), extra


def test_cache_must_be_a_boolean(cached):
    r = httpx.post(f"{cached.url}/v1/embeddings", json={"input": ["a"], "cache": "no"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache"


def test_the_lru_stays_within_its_bytes_and_evicts_the_oldest():
    out = SequenceOutput()
    out.dense = np.arange(100, dtype=np.float32)
    cache = OutputCache(3 * 700, "model", "lru-test")
    keys = [cache.key([101, i, 102], DENSE_ONLY) for i in range(5)]
    for k in keys:
        cache.put(k, out)
    assert cache.bytes <= 3 * 700
    assert cache.get(keys[0]) is None and cache.get(keys[1]) is None  # the two oldest went
    hit = cache.get(keys[4])
    assert hit is not None and hit.dense.tobytes() == out.dense.tobytes()
    assert hit.dense is not out.dense  # a copy: a caller cannot change what the cache holds


class RedisServer:
    """Debian's redis-server on a free loopback port, no persistence; ready when it says so."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (make test installs it: apt-get install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the event meant: its own ready line
            if "Ready to accept connections" in line:
                break
        else:
            raise RuntimeError(f"redis-server exited with {self.proc.wait()}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


def test_replicas_share_what_one_computed_through_redis(redis_server):
    corpus = read_corpus("passages.jsonl", 24)
    flags = ("--cache-url", redis_server.url, "--data-parallel-size", "1")
    with ServerProcess(*flags) as a:
        cold = embed(a.url, corpus)
    # Another server (another pod): no in-process cache, every sequence from Redis.
    with ServerProcess(*flags) as b:
        warm = embed(b.url, corpus)
        assert metric(b.url, "embed_cache_hits_total") == len(corpus)
        assert metric(b.url, "embed_cache_misses_total") == 0
        assert metric(b.url, "embed_cache_redis_errors_total") == 0
    assert warm == cold


def test_a_redis_outage_degrades_to_computing():
    redis = RedisServer()
    with ServerProcess("--cache-url", redis.url, "--data-parallel-size", "1") as server:
        texts = read_corpus("queries.jsonl", 8)
        before = embed(server.url, texts, cache=False)
        redis.stop()
        during = embed(server.url, texts)
        assert during == before
        assert metric(server.url, "embed_cache_redis_errors_total") >= 1
        assert metric(server.url, "embed_cache_misses_total") == len(texts)


def test_outputs_round_trip_through_the_redis_format():
    out = SequenceOutput()
    out.dense = np.linspace(-1, 1, 7, dtype=np.float32)
    out.colbert = np.arange(12, dtype=np.float32).reshape(3, 4)
    out.sparse = Sparse(np.array([3, 9], dtype=np.int32), np.array([0.5, 0.25], dtype=np.float32))
    back = unpack(pack(out))
    assert back.dense.tobytes() == out.dense.tobytes() and back.dense.dtype == np.float32
    assert back.colbert.tobytes() == out.colbert.tobytes() and back.colbert.shape == (3, 4)
    assert back.sparse.indices.tobytes() == out.sparse.indices.tobytes()
    assert back.sparse.values.tobytes() == out.sparse.values.tobytes()
    assert back.score is None


def test_info_says_the_guarantee_holds_as_the_self_check_proved(cached):
    info = httpx.get(f"{cached.url}/info", timeout=30).json()
    model = info["models"][0] if "models" in info else info
    check = model["batch_invariance"]
    assert check["enabled"] and check["verified"], check
    # three probes on every replica, and on every replica's priority lane (CPU, tensor-parallel size 1)
    assert model["priority_lanes"] == (model["device"] == "cpu" and model["tensor_parallel_size"] == 1)
    assert check["checked"] == 3 * model["data_parallel_size"] * (2 if model["priority_lanes"] else 1)
    assert model["cache"] == {"bytes": 20000000, "redis": False}
