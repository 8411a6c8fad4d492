"""`--http-processes 2`, the death paths of the front-end/engine channel, through live processes: a front
end killed with requests in flight is restarted while the other serves (its in-flight requests are lost
with their TCP connections); an engine process that dies fails every pending call at once with 503 and
/health says so; a call past its deadline is a 503 and the engine's work for it is cancelled; an error the
engine cannot send (or an answer it cannot) is a 500 for that call only, and later calls are answered.
Every wait is on an event: a log line, a pid, a /health state, a metric, an answer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server import ServerProcess, free_port, wait_until
from tests.test_frontends import FLAGS, TEXTS, alive, embed, metric
from tests.test_tracing import Collector, traceparent

WAIT_S = 120.0  # the most any event below is waited for: past it the test fails (it never passes on time)
LIMIT = 6  # --max-connections: room for the test's connections at once (3 and a few closing), not one more
SLOW = ["an input that keeps the engine busy for a while " * 8] * 200  # with --max-batch-requests 1


def frontends(server: ServerProcess) -> list[int]:
    """The pids of the server's HTTP front-end processes (its spawned children that are not workers)."""
    top = psutil.Process(server.proc.pid)
    return sorted(
        c.pid
        for c in top.children()
        if "spawn_main" in " ".join(c.cmdline())
        and any(k.laddr.port == server.port for k in c.net_connections())
    )


def wait_for(what: str, predicate, server: ServerProcess) -> None:
    wait_until(predicate, what, server, WAIT_S)


def open_request(server: ServerProcess, texts: list[str]) -> socket.socket:
    """A raw POST /v1/embeddings left open: the caller reads (or drops) the answer."""
    body = json.dumps({"input": texts}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def holder(server: ServerProcess, client: socket.socket) -> int:
    """The front end that accepted `client`'s connection."""
    port = client.getsockname()[1]
    for pid in frontends(server):
        if any(k.raddr and k.raddr.port == port for k in psutil.Process(pid).net_connections()):
            return pid
    raise LookupError(f"no front end holds the connection from port {port}")


def served_on_each(server: ServerProcess, n: int) -> bool:
    """`n` connections open at once, each answered (not the 503 of --max-connections)."""
    clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(n)]
    try:
        return all(c.post("/v1/embeddings", json={"input": ["x"]}).status_code == 200 for c in clients)
    finally:
        for c in clients:
            c.close()


def test_a_killed_front_end_is_restarted_while_the_other_serves():
    flags = ("--http-processes", "2", "--max-batch-requests", "1", "--max-connections", str(LIMIT))
    server = ServerProcess(*FLAGS, *flags).wait_healthy()
    try:
        before = frontends(server)
        assert len(before) == 2, before
        client = open_request(server, SLOW)
        wait_for(
            "the slow request's first batch",
            lambda: metric(server.url, "embed_batch_size_count") >= 1,
            server,
        )
        victim = holder(server, client)
        os.kill(victim, signal.SIGKILL)
        # Its in-flight request is lost with its TCP connection: the client sees the connection end.
        client.settimeout(WAIT_S)
        try:
            rest = client.recv(65536)
        except ConnectionResetError:
            rest = b""
        assert rest == b"", rest  # no answer on it: it ended
        client.close()
        # The survivor serves meanwhile; the killed one's work in the engine is cancelled.
        with ThreadPoolExecutor(3) as pool:  # within --max-connections, the killed one's counted still
            answers = list(pool.map(lambda t: embed(server.url, [t]), TEXTS * 2))
        assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
        wait_for(
            "the front end's restart",
            lambda: len(frontends(server)) == 2 and victim not in frontends(server),
            server,
        )
        assert "restarted" in server.output()
        wait_for(
            "the killed request's work dropped", lambda: metric(server.url, "embed_queue_size") == 0, server
        )
        assert metric(server.url, "embed_batch_size_sum") < len(SLOW)
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
        assert server.proc.poll() is None  # the server never exited
        # The new front end serves: every connection gets an answer, whichever process accepts it.
        with ThreadPoolExecutor(3) as pool:
            codes = [r.status_code for r in pool.map(lambda t: embed(server.url, [t]), TEXTS * 4)]
        assert codes == [200] * len(codes)
        # The killed front end's open connection is not counted against --max-connections any more (once
        # the connections closed above are reaped, every one of the limit's connections is served).
        wait_for(f"{LIMIT} connections served at once", lambda: served_on_each(server, LIMIT), server)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()


def test_an_engine_process_that_dies_fails_pending_calls_with_503_at_once():
    server = ServerProcess(*FLAGS, "--http-processes", "2", "--max-batch-requests", "1").wait_healthy()
    try:
        ends = frontends(server)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(embed, server.url, SLOW)
            wait_for(
                "the slow request's first batch",
                lambda: metric(server.url, "embed_batch_size_count") >= 1,
                server,
            )
            os.kill(server.proc.pid, signal.SIGKILL)  # the engine process
            answer = pending.result(WAIT_S)
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["type"] == "service_unavailable" and "engine process" in error["message"], error
        assert answer.headers["retry-after"]
        # Until it exits, the front end answers 503 at once, and /health says why.
        try:
            later = embed(server.url, ["after the engine died"])
            health = httpx.get(server.url + "/health", timeout=30)
        except httpx.TransportError:  # the front ends exited already (FATAL_EXIT_DELAY_S after the EOF)
            pass
        else:
            assert later.status_code == 503, later.text
            assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
        wait_until(
            lambda: not any(alive(p) for p in ends), "the front ends to exit after their engine", None, WAIT_S
        )
    finally:
        try:  # the session's leader is gone: server.kill() would not look for the rest
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.kill()


def test_a_call_past_its_deadline_is_a_503_and_later_calls_are_answered():
    server = ServerProcess(*FLAGS, "--http-processes", "2", "--engine-call-timeout", "3").wait_healthy()
    try:
        assert embed(server.url, TEXTS).status_code == 200
        os.kill(server.proc.pid, signal.SIGSTOP)  # the engine process stops answering
        try:
            answer = embed(server.url, TEXTS)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert answer.status_code == 503, answer.text
        assert "did not answer within 3 s" in answer.json()["error"]["message"]
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
        assert embed(server.url, TEXTS).status_code == 200
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        server.stop()


# --- errors the engine cannot send, with a stand-in engine (tests/stub_engine.py) ------------------------------


class StubServer(ServerProcess):
    """tests/stub_engine.py in a subprocess, killed as a ServerProcess is."""

    def __init__(self) -> None:  # noqa: D107 (ServerProcess's, with another command)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="embed-stub-", suffix=".log", delete=False)
        script = Path(__file__).with_name("stub_engine.py")
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        ServerProcess.running.add(self)


@pytest.fixture(scope="module")
def stub():
    server = StubServer().wait_healthy()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("what", ["unpicklable error", "validation error", "unpicklable answer"])
def test_an_error_the_engine_cannot_send_is_a_500_for_that_call_only(stub, what):
    with ThreadPoolExecutor(4) as pool:  # calls in flight beside the failing one are answered too
        beside = [pool.submit(embed, stub.url, [f"fine {i}"]) for i in range(8)]
        failing = embed(stub.url, [what])
        answers = [b.result(WAIT_S) for b in beside]
    assert failing.status_code == 500, failing.text
    assert failing.json() == {
        "error": {"message": "internal error", "type": "server_error", "param": None, "code": None}
    }
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert embed(stub.url, ["fine after"]).status_code == 200
    assert httpx.get(stub.url + "/health", timeout=30).json()["status"] == "ok"
    assert stub.output().count("failed on an unexpected error") >= 1


def test_an_engine_refusal_keeps_its_kind_message_and_param(stub):
    answer = embed(stub.url, ["refusal"])
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "the stub refuses this",
        "type": "invalid_request_error",
        "param": "dimensions",
        "code": None,
    }


def test_the_unexpected_error_is_logged_once(stub):
    before = stub.output().count("failed on an unexpected error")
    assert embed(stub.url, ["unpicklable error"]).status_code == 500
    wait_for(
        "the error's log line", lambda: stub.output().count("failed on an unexpected error") > before, stub
    )
    assert stub.output().count("failed on an unexpected error") == before + 1


def test_a_requests_spans_stay_one_tree_across_the_channel():
    with Collector() as collector:
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 100 ms instead of every 5 s
        with ServerProcess(*FLAGS, "--http-processes", "2", "--otlp-endpoint", endpoint, env=env) as server:
            header, _, trace_id, _ = traceparent(4)
            answer = httpx.post(
                server.url + "/v1/embeddings",
                json={"input": ["hello", "world"]},
                headers={"traceparent": header},
            )
            assert answer.status_code == 200
            # the front end's server span and tokenization; the engine process's queue and inference
            wanted = {"POST /v1/embeddings", "tokenize", "queue", "inference"}

            def mine() -> list:
                return [s for _, s in collector.spans() if int.from_bytes(s.trace_id, "big") == trace_id]

            wait_for("the request's spans", lambda: {s.name for s in mine()} >= wanted, server)
        collector.shutdown()
    spans = mine()
    [server_span] = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert {s.name for s in spans if s.parent_span_id == server_span.span_id} >= wanted - {server_span.name}
