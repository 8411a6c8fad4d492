"""Start-up, overload and shutdown as an orchestrator and a client see them."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx

from tests.server import ServerProcess, read_corpus


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.split()[-1])
    return total


def test_loading_answers_503_then_200():
    server = ServerProcess("--dtype", "float32")
    try:
        saw_loading = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(server.url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            if health.status_code == 200:
                break
            assert health.status_code == 503
            saw_loading = True
            assert httpx.get(server.url + "/live").status_code == 200
            r = httpx.post(server.url + "/v1/embeddings", json={"input": "too early"})
            if r.status_code == 503:  # the model may have become ready in between
                assert r.json()["error"]["type"] == "service_unavailable"
        assert saw_loading, "the socket only opened once the model was ready"
        assert httpx.post(server.url + "/v1/embeddings", json={"input": "now"}).status_code == 200
    finally:
        server.stop()


def test_health_answers_fast_while_a_long_batch_computes():
    texts = read_corpus("passages.jsonl", 150)
    with ServerProcess("--dtype", "float32", "--max-batch-tokens", "65536") as s:
        result: dict = {}
        t = threading.Thread(
            target=lambda: result.setdefault(
                "r", httpx.post(s.url + "/v1/embeddings", json={"input": texts}, timeout=300)
            )
        )
        t.start()
        while metric(s.url, "embed_batch_size_count") < 1 and t.is_alive():
            time.sleep(0.01)  # wait until the first (long) batch is running
        latencies = []
        while t.is_alive() and len(latencies) < 10:
            start = time.perf_counter()
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            latencies.append(time.perf_counter() - start)
        t.join()
        assert result["r"].status_code == 200
        assert latencies, "the batch finished before /health could be asked"
        latencies.sort()
        assert latencies[len(latencies) // 2] < 0.1, latencies


def test_a_request_whose_client_disconnects_is_not_computed():
    # One sequence per batch: a 200-input request takes many batches, so most are still queued at the cut.
    with ServerProcess("--dtype", "float32", "--max-batch-requests", "1") as s:
        body = httpx.Request(
            "POST",
            s.url + "/v1/embeddings",
            json={"input": ["a queued input that should never run " * 8] * 200},
        ).content
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        while metric(s.url, "embed_batch_size_count") < 1:
            time.sleep(0.01)
        sock.close()  # the client goes away with most of its inputs still queued
        deadline = time.monotonic() + 30
        while metric(s.url, "embed_queue_size") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        computed = metric(s.url, "embed_batch_size_sum")
        assert metric(s.url, "embed_queue_size") == 0
        assert computed < 100, f"{computed} of 200 sequences were computed after the client left"
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "still serving"}).status_code == 200
        assert metric(s.url, 'embed_requests_total{model="all-MiniLM-L6-v2",status="499"}') == 1


def test_sigterm_answers_admitted_requests_then_exits_0():
    s = ServerProcess("--dtype", "float32", "--max-batch-requests", "1").wait_healthy()
    texts = read_corpus("passages.jsonl", 16)
    results: list[httpx.Response] = []

    def client() -> None:
        results.append(httpx.post(s.url + "/v1/embeddings", json={"input": texts}, timeout=120))

    threads = [threading.Thread(target=client) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (
            metric(s.url, "embed_inputs_in_flight") + metric(s.url, "embed_batch_size_count") < 6 * len(texts)
            and time.monotonic() < deadline
        ):
            # Until all six are admitted (an input leaves the in-flight count once answered).
            time.sleep(0.005)
        assert metric(s.url, "embed_batch_size_count") < 6 * len(texts)  # work is still in flight
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        late = None
        try:
            late = httpx.post(s.url + "/v1/embeddings", json={"input": "late"}, timeout=10)
            health = httpx.get(s.url + "/health", timeout=10)
        except httpx.TransportError:
            health = None  # already drained and closed: also no admission
        if late is not None:
            assert late.status_code == 503
            assert health is not None and health.status_code == 503
        for t in threads:
            t.join(120)
        assert s.proc.wait(60) == 0, s.output()
    finally:
        s.stop()
    assert len(results) == 6
    assert all(r.status_code == 200 for r in results), [r.status_code for r in results]
    assert all(len(r.json()["data"]) == len(texts) for r in results)
