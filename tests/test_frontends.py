"""`--http-processes 2`: two HTTP processes in front of one engine process answer as one process does (the
same vectors, bit for bit; errors in the same shape), count every request in /metrics, and all stop on
SIGTERM. The front ends tokenize texts themselves (with the engine's code) and send token ids: prompts,
truncation, budgets and their refusals must come out as the one-process server gives them."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import HANG_S, ServerProcess, abandoned_while_queued, wait_until, workers_held

FLAGS = ("--dtype", "float32", "--data-parallel-size", "1")
TEXTS = [
    "a short one",
    "Two HTTP processes share the port; one process runs the model.",
    "ünïcödé ✓",
    "x" * 300,
]
# Budgets small enough to pass with small bodies (the default model: 256 tokens at most).
LIMITS = ("--max-input-chars", "5000", "--max-request-chars", "200000")
LONG = " ".join(f"word{i}" for i in range(400))  # ~1,200 tokens: past the max input length


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (the front ends, the engine's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def servers():
    one = ServerProcess(*FLAGS, *LIMITS)
    two = ServerProcess(*FLAGS, *LIMITS, "--http-processes", "2")
    try:
        yield one.wait_healthy(), two.wait_healthy()
    finally:
        one.stop()
        two.stop()


def embed(url: str, texts: list[str], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"input": texts, **extra}, timeout=60)


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def test_vectors_equal_the_one_process_servers_bit_for_bit(servers):
    one, two = servers
    for extra in ({}, {"dimensions": 128}, {"encoding_format": "base64"}):
        a, b = embed(one.url, TEXTS, **extra), embed(two.url, TEXTS, **extra)
        assert a.status_code == b.status_code == 200
        assert a.json()["data"] == b.json()["data"]  # the same floats (or base64 bytes): bit for bit
        assert a.json()["usage"] == b.json()["usage"]


@pytest.mark.parametrize(
    "texts, extra",
    [
        (TEXTS, {"prompt": "query: "}),
        ([LONG, "short", LONG + " tail"], {}),  # cut to the max input length (--auto-truncate)
        ([LONG, "short"], {"truncation_direction": "left", "prompt": "query: "}),  # the prompt is kept
        ([LONG + " " + LONG, "é " * 3000], {"dimensions": 64}),  # past --max-input-chars: cut, tokenized
        ([LONG] * 40, {"prompt": "passage: "}),  # on the tokenization threads, in several calls
        ([LONG, "short"], {"chunking": {"overlap": 16}}),  # chunked: the texts go to the engine process
    ],
)
def test_front_end_tokenization_equals_the_engines_bit_for_bit(servers, texts, extra):
    one, two = servers
    a, b = embed(one.url, texts, **extra), embed(two.url, texts, **extra)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["data"] == b.json()["data"]
    assert a.json()["usage"] == b.json()["usage"]  # prompt_tokens: the same ids counted
    if not extra:  # Cohere's embed goes through the same engine.embed
        model = httpx.get(one.url + "/info", timeout=30).json()["model"]
        cohere = {
            "texts": texts[:2],
            "model": model,
            "input_type": "search_query",
            "embedding_types": ["float"],
        }
        ca = httpx.post(one.url + "/v2/embed", json=cohere, timeout=60)
        cb = httpx.post(two.url + "/v2/embed", json=cohere, timeout=60)
        assert ca.status_code == cb.status_code == 200, (ca.text, cb.text)
        assert ca.json()["embeddings"] == cb.json()["embeddings"]
        assert ca.json()["meta"]["billed_units"] == cb.json()["meta"]["billed_units"]


@pytest.mark.parametrize(
    "texts, extra",
    [
        ([LONG], {"truncate": False}),  # past the max input length: 400, no cut
        (["ok", LONG], {"truncate": False, "prompt": "q: "}),  # the index named is the second input
        (["ok"], {"prompt": LONG}),  # a prompt that leaves no room for the text
        (["ok"], {"prompt": "p" * 5000}),  # a prompt past --max-input-chars: the budget check
        (["y" * 6000], {"truncate": False}),  # past --max-input-chars, truncation off
        (["y" * 6000], {}),  # no max-length's worth of tokens within --max-input-chars
        (["z" * 4000] * 60, {}),  # 240,000 characters: past --max-request-chars
        (["ok"], {"prompt": "a", "prompt_name": "query"}),
        (["ok"], {"truncation_direction": "left", "dimensions": 0}),  # the first refusal wins
    ],
)
def test_front_end_refusals_equal_the_engines(servers, texts, extra):
    one, two = servers
    a, b = embed(one.url, texts, **extra), embed(two.url, texts, **extra)
    assert a.status_code == b.status_code == 400, (a.text, b.text)
    assert a.json() == b.json()  # message, type, param and code


def test_concurrent_clients_are_all_answered(servers):
    one, two = servers
    reference = {t: vectors(embed(one.url, [t]))[0] for t in TEXTS}
    jobs = [TEXTS[i % len(TEXTS)] for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda t: embed(two.url, [t]), jobs))
    for text, answer in zip(jobs, answers):
        # batched with others: the same vector to float32 rounding (batch composition may change the sums)
        np.testing.assert_allclose(vectors(answer)[0], reference[text], atol=1e-5)


def test_errors_come_in_the_same_shape(servers):
    one, two = servers
    cases = [
        ({"input": []}, 400),
        ({"input": "x", "model": "no-such-model"}, 404),
        ({"input": "x", "dimensions": 0}, 400),
    ]
    for body, status in cases:
        a = httpx.post(one.url + "/v1/embeddings", json=body, timeout=30)
        b = httpx.post(two.url + "/v1/embeddings", json=body, timeout=30)
        assert a.status_code == b.status_code == status, (body, a.text, b.text)
        assert a.json() == b.json()
        assert set(b.json()["error"]) == {"message", "type", "param", "code"}
    assert {httpx.get(s.url + "/health").json()["status"] for s in servers} == {"ok"}
    info = httpx.get(two.url + "/info").json()
    assert info["model"] == httpx.get(one.url + "/info").json()["model"]


def requests_counted(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "embed_requests":
            for s in family.samples:
                if s.name == "embed_requests_total":
                    counts[s.labels["status"]] = counts.get(s.labels["status"], 0) + s.value
        if family.name == "embed_input_tokens":  # the engine's own series are there too
            counts["tokens"] = sum(s.value for s in family.samples if s.name == "embed_input_tokens_total")
        if family.name == "embed_tokenization_duration_seconds":  # the front ends' (texts tokenized there)
            counts["tokenized"] = sum(
                s.value for s in family.samples if s.name == "embed_tokenization_duration_seconds_count"
            )
    return counts


def test_metrics_count_every_request_and_the_engines_series(servers):
    deltas = []
    for server in servers:  # the same traffic: the same counts as one process (its scrapes counted too)
        before = requests_counted(server.url)
        with ThreadPoolExecutor(8) as pool:  # spread over both front ends
            codes = list(pool.map(lambda i, s=server: embed(s.url, [f"text {i}"]).status_code, range(20)))
        codes.append(embed(server.url, []).status_code)
        after = requests_counted(server.url)
        assert codes.count(200) == 20 and codes[-1] == 400
        assert after["tokens"] > before.get("tokens", 0)
        deltas.append(
            {k: v - before.get(k, 0) for k, v in after.items() if k != "tokens" and v != before.get(k)}
        )
    assert deltas[0] == deltas[1]
    assert deltas[1]["200"] >= 20 and deltas[1]["400"] == 1
    assert deltas[1]["tokenized"] == 20  # one tokenization per text request, as in one process


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_disconnect_cancels_and_sigterm_stops_every_process():
    # One sequence per batch, one replica, its worker held while the client goes away: at most the batch
    # sent before the cut is computed, on any CPU (was: "most" of 200 still queued after a batch ran).
    server = ServerProcess(*FLAGS, "--http-processes", "2", "--max-batch-requests", "1").wait_healthy()
    below = descendants(server.proc.pid)
    assert len(below) >= 3, below  # two front ends and a worker at least
    body = json.dumps({"input": ["a queued input that should never run " * 8] * 200}).encode()
    abandoned_while_queued(server, body)
    # Answered after any batch sent before it (one replica, one batch at a time): then all is counted.
    assert embed(server.url, ["still serving"]).status_code == 200
    assert metric(server.url, "embed_batch_size_sum") - 1 <= 2  # the engine process dropped the rest
    with ThreadPoolExecutor(4) as pool:  # in flight while SIGTERM comes: answered, not dropped
        with workers_held(server):
            pending = [pool.submit(embed, server.url, TEXTS) for _ in range(4)]
            wait_until(
                lambda: metric(server.url, "embed_inputs_in_flight") == 4 * len(TEXTS), "all admitted", server
            )
            server.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "draining" in server.output(), "the drain to begin", server)
        statuses = [p.result().status_code for p in pending]
    assert server.proc.wait(HANG_S) == 0, server.output()
    server.stop()
    assert statuses == [200] * 4, statuses
    wait_until(lambda: not any(alive(p) for p in below), "every process to exit", server)


def test_max_connections_is_the_whole_servers_over_every_front_end():
    """Was: each front end counted its own connections, so `--http-processes 2 --max-connections 4` served
    up to 8 at once (docs/configuration.md calls it a server setting, one value for the whole server)."""
    from tests.api.rawhttp import connect, head, read_reply

    limit = 4
    server = ServerProcess(
        *FLAGS,
        "--http-processes", "2",
        "--max-connections", str(limit),
        "--keep-alive-timeout", "120",
        "--header-timeout", "120",
    ).wait_healthy()  # fmt: skip
    held, statuses = [], []
    try:
        # One after another, each answered before the next opens and then held open (kept alive): which
        # front end accepts each is the kernel's choice; the count must not depend on it.
        for _ in range(3 * limit):
            sock = connect(server.port)
            sock.sendall(head("GET", "/live"))
            reply = read_reply(sock)
            assert reply is not None
            statuses.append(reply.status)
            if reply.status == 200:
                held.append(sock)
            else:
                assert reply.json()["error"]["code"] == "too_many_connections"
                assert f"more than {limit} open connections" in reply.json()["error"]["message"]
                sock.close()
        print(f"\n{3 * limit} connections, {limit} allowed over 2 front ends: statuses {statuses}")
        assert statuses == [200] * limit + [503] * (2 * limit)
        held.pop().close()  # one closes: the server sees it, and one more is served, whichever front end
        sock = connect(server.port)
        for _ in range(600):  # the close is seen within moments: retried until it is (a 503 closes its own)
            sock.sendall(head("GET", "/live"))
            reply = read_reply(sock)
            if reply is not None and reply.status == 200:
                break
            sock.close()
            time.sleep(0.05)
            sock = connect(server.port)
        assert reply is not None and reply.status == 200
        held.append(sock)
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_info_shows_the_plan_with_the_front_ends_and_their_tokenizer_threads(servers):
    one, two = (httpx.get(s.url + "/info", timeout=30).json()["plan"] for s in servers)
    assert (one["http_processes"], one["frontend_cores"], one["tokenizer_threads"]) == (0, 0, 2)
    assert two["http_processes"] == 2 and two["tokenizer_threads"] == 2 * 3
    # the cores kept for the front ends: one each where the workers still have one each
    workers = sum(m["replicas"] * m["tensor_parallel_size"] for m in two["models"])
    assert two["frontend_cores"] == min(2, max(0, two["cores"] - workers))
    assert two["threads"] + two["frontend_cores"] <= max(two["cores"], workers)
    assert any("2 HTTP processes" in line for line in two["lines"])
