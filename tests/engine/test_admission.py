"""Admission on a live server: every route bounded before its cost is paid, prompts that leave no room
refused, a large request admitted piecewise beside short ones. Each test is a reproduction of a way one
request could exhaust the server; the figures are printed (pytest -s)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from transformers import AutoTokenizer

from tests.server import ServerProcess, wait_until

MAX_LENGTH = 256  # all-MiniLM-L6-v2's
HEAVY_LIMIT = 32 * 1024 * 1024


@pytest.fixture(scope="module")
def server():
    # Request limits above the default 8 MiB: the part of a request tokenized before its client goes away must
    # be a small part of the whole one for the cancellation test to tell them apart.
    limit = str(HEAVY_LIMIT)
    with ServerProcess("--max-request-bytes", limit, "--max-request-chars", limit) as s:
        yield s


@pytest.fixture(scope="module")
def hf(default_model_path):
    return AutoTokenizer.from_pretrained(str(default_model_path))


def post(server, route: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=timeout)


def rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def cpu(server) -> float:
    t = psutil.Process(server.proc.pid).cpu_times()
    return t.user + t.system


def in_flight(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("embed_inputs_in_flight{")
    )


def tokenized(server) -> float:
    """Pieces of input tokenized so far (the tokenization histogram's count)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("embed_tokenization_duration_seconds_count{")
    )


def status_count(server, status: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("embed_requests_total{") and f'status="{status}"' in line
    )


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]


def test_a_prompt_is_counted_once_per_input_before_anything_is_tokenized(server, hf):
    """Was: 104 s of CPU and ~1 GB resident for a 1 MiB body (the prompt copied into all 256 texts)."""
    before, pieces = rss(server), tokenized(server)
    t0 = time.perf_counter()
    r = post(server, "/v1/embeddings", {"input": ["x"] * 256, "prompt": "a" * 1048576})
    huge = time.perf_counter() - t0
    err = error(r, 400)
    assert err["param"] == "prompt" and "1048576 characters" in err["message"]
    # A prompt within the per-input limit that the request would multiply past its budget.
    counted = 512 * (100000 + 1)  # 512 inputs of one character, each with the prompt
    assert counted > HEAVY_LIMIT
    for route in ("/v1/embeddings", "/tokenize"):
        err = error(post(server, route, {"input": ["x"] * 512, "prompt": "a " * 50000}), 400)
        assert "counted once per input" in err["message"] and str(counted) in err["message"]
    grown = rss(server) - before
    print(f"\n256 inputs x 1 MiB prompt: 400 in {huge:.3f} s, resident +{grown / 2**20:.1f} MiB")
    assert tokenized(server) == pieces  # refused before the tokenizer saw any of it, on any CPU
    assert grown < 64 * 2**20
    # A long prompt that fits is served, as the tokenizer applies it.
    prompt = "represent this for retrieval " * 20
    r = post(server, "/tokenize", {"input": ["x", "y z"], "prompt": prompt})
    assert [d["tokens"] for d in r.json()["data"]] == [hf(prompt + t).input_ids for t in ("x", "y z")]


def test_tokenize_has_the_client_batch_limit(server):
    err = error(post(server, "/tokenize", {"input": ["word"] * 2049}), 400)
    assert "2049 inputs" in err["message"] and "2048" in err["message"]
    assert len(post(server, "/tokenize", {"input": ["word"] * 2048}).json()["data"]) == 2048


def test_a_long_text_is_cut_before_the_tokenizer_with_the_whole_texts_result(server, hf):
    """Was: a 7 MB text (3.5 M tokens, truncated to 256 afterwards) left +1.1 GB resident; four, 4 GB."""
    reference_text = "a " * 500_000  # 1 MB: the reference tokenizes it whole
    for side in ("right", "left"):
        expected = AutoTokenizer.from_pretrained(str(hf.name_or_path), truncation_side=side)(
            reference_text + ("b" if side == "left" else ""), truncation=True, max_length=MAX_LENGTH
        ).input_ids
        r = post(
            server,
            "/tokenize",
            {"input": reference_text + ("b" if side == "left" else ""), "truncation_direction": side},
        )
        assert r.json()["data"][0]["tokens"] == expected
    before = rss(server)
    results: list[httpx.Response] = []
    big = {"input": "a " * 3_500_000}  # 7 MB

    def client() -> None:
        results.append(post(server, "/tokenize", big, timeout=120))

    threads = [threading.Thread(target=client) for _ in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    grown = rss(server) - before
    print(f"\n4 x 7 MB texts to /tokenize: {took:.2f} s, resident +{grown / 2**20:.1f} MiB")
    assert all(r.status_code == 200 and r.json()["data"][0]["tokens"] == expected_right(hf) for r in results)
    assert grown < 128 * 2**20  # the bodies themselves (4 x 7 MB, freed or reused); no token lists


def test_long_texts_to_tokenize_do_not_stall_embeddings(server):
    """Was: 50 clients posting "word " * 200000 to /tokenize pushed a 6-text embeddings request from p50
    8 ms to 8.4 s (the shared tokenizer threads read every character). The texts are tokenized a piece at a
    time, so a request that arrives behind long ones waits for a piece of each, not for the whole of them:
    it is answered while the long ones admitted before it are still being read. The order is the test, on
    any CPU, not a time: each long request is about 400 pieces (heavy_tokenize_body), the short one 1."""
    six = {"input": [f"a short query number {i}" for i in range(6)]}

    def answer() -> float:
        t0 = time.perf_counter()
        assert post(server, "/v1/embeddings", six).status_code == 200
        return time.perf_counter() - t0

    idle = float(np.median([answer() for _ in range(5)]))
    body = heavy_tokenize_body()
    statuses: list[int] = []

    def long_texts() -> None:
        r = httpx.post(
            server.url + "/tokenize", content=body, timeout=120, headers={"content-type": "application/json"}
        )
        statuses.append(r.status_code)

    threads = [threading.Thread(target=long_texts) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # Admitted piecewise (the capacity is below 2,048 inputs): in flight once the first piece is in.
        wait_until(lambda: in_flight(server) > 0 or statuses, "a long request to be admitted")
        busy = answer()
        answered_first = len(statuses)
    finally:
        for t in threads:
            t.join()
    print(
        f"\n6-text embeddings: {idle * 1000:.0f} ms idle (p50), {busy * 1000:.0f} ms behind 2 requests of 24 M "
        f"characters to /tokenize, {answered_first} of which were answered first"
    )
    assert statuses == [200, 200]
    assert answered_first == 0, "the short request waited for the long ones admitted before it"


def expected_right(hf) -> list[int]:
    return hf("a " * 1000, truncation=True, max_length=MAX_LENGTH).input_ids


def heavy_tokenize_body() -> bytes:
    """2,048 texts of 12,000 characters, mostly spaces: about 24 M characters for the tokenizer to read (about 4
    CPU seconds on 2 shared AMD EPYC cores), in pieces of at most 65,536 characters (about 400)."""
    import orjson

    body = orjson.dumps({"input": ["a" + " " * 11998 + "b"] * 2048})
    assert len(body) < HEAVY_LIMIT
    return body


def test_tokenize_is_counted_in_flight_and_stops_when_the_client_goes_away(server):
    body = heavy_tokenize_body()
    # Whole: counted in flight while it runs (was: invisible to admission and the drain).
    seen = 0.0
    done = threading.Event()

    def run_whole() -> None:
        r = httpx.post(
            server.url + "/tokenize", content=body, timeout=120, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200
        done.set()

    c0 = cpu(server)
    t = threading.Thread(target=run_whole)
    t.start()
    while not done.is_set():
        seen = max(seen, in_flight(server))
        time.sleep(0.01)
    t.join()
    whole_cpu = cpu(server) - c0
    assert seen > 0
    # Abandoned as soon as its tokenization has begun (the event: it is counted in flight): the rest of it
    # is not tokenized. The server's letting go is awaited too: its 499 counted, nothing left in flight;
    # then a small request through the same tokenizer threads, which run in order, is answered after any
    # piece of the abandoned one still queued there. The CPU it cost is measured up to that point.
    c0, gone = cpu(server), status_count(server, "499")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: in_flight(server) > 0, "the abandoned request's tokenization to begin")
    wait_until(lambda: status_count(server, "499") > gone and in_flight(server) == 0, "the server to let go")
    assert post(server, "/tokenize", {"input": ["after"] * 4}).status_code == 200
    abandoned_cpu = cpu(server) - c0
    print(
        f"\n24 M characters to /tokenize: {whole_cpu:.2f} CPU s whole, {abandoned_cpu:.2f} CPU s abandoned "
        f"once begun; in flight while running: {seen:.0f}"
    )
    assert abandoned_cpu < 0.5 * whole_cpu


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_prompt_that_leaves_no_room_is_refused_and_special_tokens_are_kept(server, hf, side):
    """Was: a 200 with identical vectors for every input (right: no [SEP]; left: no [CLS])."""
    for words in (254, 300):  # 254 prompt tokens + [CLS] + [SEP] = 256: no room for text
        err = error(
            post(
                server,
                "/v1/embeddings",
                {"input": ["one", "two"], "prompt": "word " * words, "truncation_direction": side},
            ),
            400,
        )
        assert err["param"] == "prompt"
        assert f"{words} tokens" in err["message"] and f"{MAX_LENGTH} tokens" in err["message"]
    prompt = "word " * 252  # leaves room for 2 tokens of text
    texts = ["alpha beta gamma " * 40, "delta epsilon zeta " * 40]
    r = post(server, "/tokenize", {"input": texts, "prompt": prompt, "truncation_direction": side})
    for d, text in zip(r.json()["data"], texts):
        tokens = d["tokens"]
        assert len(tokens) == MAX_LENGTH and tokens[0] == hf.cls_token_id and tokens[-1] == hf.sep_token_id
        full = hf(prompt + text).input_ids
        kept = full[1:253]  # the prompt
        assert tokens[1:253] == kept
        assert tokens[253:255] == (full[253:255] if side == "right" else full[-3:-1])
    r = post(server, "/v1/embeddings", {"input": texts, "prompt": prompt, "truncation_direction": side})
    a, b = (np.array(d["embedding"]) for d in r.json()["data"])
    assert float(a @ b) < 0.9999  # the texts still matter


def test_a_large_request_is_admitted_piecewise_beside_short_and_large_ones(server):
    """Was: one 2,048-input request made every other request a 429 for its whole duration, and a second
    2,048-input request arriving while anything ran was refused forever."""
    words = "the quick brown fox jumps over the lazy dog and keeps running through the field"
    big = [f"{i} {words}" for i in range(2048)]
    idle = []
    for i in range(10):
        t0 = time.perf_counter()
        assert post(server, "/v1/embeddings", {"input": f"query {i}"}).status_code == 200
        idle.append(time.perf_counter() - t0)
    results: dict[str, httpx.Response] = {}
    finished: dict[str, float] = {}
    t_start = time.perf_counter()

    def client(name: str, inputs: list[str]) -> None:
        results[name] = post(server, "/v1/embeddings", {"input": inputs}, timeout=300)
        finished[name] = time.perf_counter() - t_start

    first = threading.Thread(target=client, args=("first", big))
    first.start()
    wait_until(lambda: in_flight(server) > 0, "the first request in flight", server)
    second = threading.Thread(target=client, args=("second", big[::-1]))
    second.start()
    busy, statuses = [], []
    while first.is_alive() or second.is_alive():
        t0 = time.perf_counter()
        r = post(server, "/v1/embeddings", {"input": f"query {len(busy)}"})
        busy.append(time.perf_counter() - t0)
        statuses.append(r.status_code)
    first.join()
    second.join()
    print(
        f"\ntwo 2,048-input requests: answered after {finished['first']:.1f} s and {finished['second']:.1f} s; "
        f"{len(busy)} one-input requests meanwhile, p50 {np.median(busy) * 1000:.0f} ms "
        f"(idle p50 {np.median(idle) * 1000:.0f} ms), max {max(busy) * 1000:.0f} ms, statuses {set(statuses)}"
    )
    assert results["first"].status_code == 200 and results["second"].status_code == 200
    assert set(statuses) == {200}  # never locked out
    a = np.array([d["embedding"] for d in results["first"].json()["data"]])
    b = np.array([d["embedding"] for d in results["second"].json()["data"]])
    assert len(a) == len(b) == 2048
    # In order: the second sent the same texts reversed.
    assert float(np.min(np.sum(a * b[::-1], axis=1))) > 0.999
    assert float(np.max(np.sum(a[:-1] * a[1:], axis=1))) < 0.99999  # the rows are distinct texts
