"""What a slow, silent, oversized or vanishing client gets: bounded time, bounded memory, honest statuses.

Raw sockets on loopback, a few connections each, against a server with short limits.
"""

from __future__ import annotations

import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.api.rawhttp import closed_within, connect, head, read_reply
from tests.server import HANG_S, ServerProcess, free_port, wait_until

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
KEEP_ALIVE = 2.0
LOOP_CLOCK_S = 0.005  # the event loop's timer resolution, with its cached clock (below)
MAX_HEAD = 8192
MAX_CONNECTIONS = 16
# Each test waits for the event it means (the server closing the connection, its answer) and checks that
# a stated timeout caused it: the time taken is at least the timeout, and the answer or count is the one
# only that timeout gives. No upper bound tied to the timeout (a loaded machine may be late by any amount):
# a connection never closed is what HANG_S, a failure bound only, catches.
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "--header-timeout", str(HEADER_TIMEOUT),
        "--body-timeout", str(BODY_TIMEOUT),
        "--keep-alive-timeout", str(KEEP_ALIVE),
        "--max-header-bytes", str(MAX_HEAD),
        "--max-connections", str(MAX_CONNECTIONS),
        "--no-docs",
    ) as s:  # fmt: skip
        yield s


def status_count(server: ServerProcess, status: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("embed_requests_total{") and f'status="{status}"' in line:
            total += float(line.split()[-1])
    return total


def full_log(server: ServerProcess) -> str:
    server.log.flush()
    return Path(server.log.name).read_text(errors="replace")


def assert_openai_error(reply, status: int) -> dict:
    assert reply is not None, "the connection was closed without an answer"
    assert reply.status == status, reply
    assert reply.headers["content-type"].startswith("application/json")
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def still_serving(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "still serving"}, timeout=30)
    assert r.status_code == 200, r.text


def test_client_gone_while_its_body_is_read_is_499_and_one_line(server):
    n = 20
    before_499, before_500 = status_count(server, "499"), status_count(server, "500")
    for _ in range(n):
        sock = connect(server.port)
        sock.sendall(
            head("POST", "/v1/embeddings", {**JSON, "Content-Length": "100", "Expect": "100-continue"})
        )
        # "100 Continue" is sent when the route first asks for the body: the head is read, the route waits
        reply = read_reply(sock, HANG_S)
        assert reply is not None and reply.status == 100, reply
        sock.sendall(b'{"input": "par')
        sock.close()
    wait_until(lambda: status_count(server, "499") >= before_499 + n, f"{n} more 499s counted", server)
    assert status_count(server, "499") == before_499 + n
    assert status_count(server, "500") == before_500 == 0
    log = full_log(server)
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert log.count("POST /v1/embeddings 499 ") == n  # the access line: one per request
    still_serving(server)


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_header_timeout(server):
    before = status_count(server, "408")
    start = time.monotonic()
    socks = [connect(server.port) for _ in range(8)]
    prefix = b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    for s in socks:
        s.sendall(prefix)
    open_socks = list(socks)
    while open_socks and time.monotonic() - start < HANG_S:
        time.sleep(0.5)
        for s in list(open_socks):
            try:
                s.sendall(b"a")
            except OSError:  # closed by the server
                open_socks.remove(s)
                continue
            if closed_within(s, 0.001):
                open_socks.remove(s)
    elapsed = time.monotonic() - start
    assert not open_socks, f"{len(open_socks)} slow heads still open after {elapsed:.1f}s"
    assert elapsed >= HEADER_TIMEOUT  # cut by the head's deadline, not before it
    assert status_count(server, "408") == before + 8  # each with the head timeout's 408
    for s in socks:
        s.close()
    still_serving(server)


def test_the_408_for_a_slow_head_is_in_the_error_shape(server):
    before = status_count(server, "408")
    start = time.monotonic()
    sock = connect(server.port)
    sock.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    err = assert_openai_error(read_reply(sock, HANG_S), 408)
    assert err["code"] == "request_timeout"
    assert time.monotonic() - start >= HEADER_TIMEOUT
    assert closed_within(sock, HANG_S)
    sock.close()
    assert status_count(server, "408") == before + 1  # counted, though no route saw it


def test_a_slow_head_after_answered_requests_on_a_kept_alive_connection_gets_the_whole_timeout(server):
    # The head deadline of a later request on a connection is the header timeout from that head's first
    # byte, not a deadline left over from the connection's earlier requests (which would fall due as
    # much earlier as those requests took).
    sock = connect(server.port)
    for _ in range(2):
        sock.sendall(head("GET", "/live"))
        assert read_reply(sock, HANG_S).status == 200
    started = time.monotonic()
    sock.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    err = assert_openai_error(read_reply(sock, HANG_S), 408)
    assert err["code"] == "request_timeout"
    assert time.monotonic() - started >= HEADER_TIMEOUT
    assert closed_within(sock, HANG_S)
    sock.close()


def test_a_declared_body_that_never_comes_is_408_at_the_body_timeout(server):
    before = status_count(server, "408")
    start = time.monotonic()
    socks = [connect(server.port) for _ in range(4)]
    for s in socks:
        s.sendall(head("POST", "/v1/embeddings", {**JSON, "Content-Length": "1000000"}))
    for s in socks:
        err = assert_openai_error(read_reply(s, HANG_S), 408)
        assert "body" in err["message"]
        assert time.monotonic() - start >= BODY_TIMEOUT
        assert closed_within(s, HANG_S)
        s.close()
    assert status_count(server, "408") == before + 4
    still_serving(server)


def test_silent_connections_are_closed(server):
    start = time.monotonic()
    socks = [connect(server.port) for _ in range(10)]
    assert all(closed_within(s, HANG_S) for s in socks)
    assert time.monotonic() - start >= HEADER_TIMEOUT  # closed by the head's deadline, not before it
    for s in socks:
        s.close()
    still_serving(server)


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = connect(server.port)
    asked = time.monotonic()  # before the answer, whose sending starts the server's timer
    sock.sendall(head("GET", "/live"))
    assert read_reply(sock).status == 200
    assert closed_within(sock, HANG_S)
    # uvicorn's keep-alive timer is the loop's call_later: on uvloop, libuv's millisecond clock cached at
    # the start of a loop iteration, so it may fire up to a few ms before KEEP_ALIVE of real time.
    assert time.monotonic() - asked >= KEEP_ALIVE - LOOP_CLOCK_S
    sock.close()


def test_a_head_past_the_limit_is_431(server):
    before = status_count(server, "431")
    # All at once: the head is complete, and too large.
    sock = connect(server.port)
    sock.sendall(head("GET", "/live", {"X-Big": "a" * (2 * MAX_HEAD)}))
    err = assert_openai_error(read_reply(sock), 431)
    assert str(MAX_HEAD) in err["message"]
    sock.close()
    # Never-ending: the server answers once the limit is passed instead of buffering what it is sent.
    sock = connect(server.port)
    sock.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
    sent, answered = 0, False
    try:
        while sent < 4 * 1024 * 1024 and not answered:
            sock.sendall(b"a" * 16384)
            sent += 16384
            answered = bool(select.select([sock], [], [], 0.001)[0])
    except OSError:
        answered = True  # reset by the server
    assert answered, f"no answer after {sent} bytes of head"
    try:
        reply = read_reply(sock, 5)
    except OSError:
        reply = None  # the reset can overtake the 431
    assert reply is None or reply.status == 431
    sock.close()
    still_serving(server)
    assert status_count(server, "431") == before + 2


def test_connections_past_the_limit_get_503_with_retry_after(server):
    before = status_count(server, "503")
    idle = [connect(server.port) for _ in range(MAX_CONNECTIONS)]
    late = connect(server.port)
    late.sendall(head("GET", "/live"))
    reply = read_reply(late)
    err = assert_openai_error(reply, 503)
    assert err["code"] == "too_many_connections"
    assert int(reply.headers["retry-after"]) >= 1
    assert closed_within(late, HANG_S)
    for s in [*idle, late]:
        s.close()
    deadline = time.monotonic() + HANG_S
    refused = 1
    while time.monotonic() < deadline:  # the server sees the closes within moments
        status = httpx.get(server.url + "/live").status_code
        if status == 200:
            break
        refused += status == 503
        time.sleep(0.1)
    still_serving(server)
    assert status_count(server, "503") == before + refused


def test_an_invalid_request_head_is_400_and_counted(server):
    before = status_count(server, "400")
    sock = connect(server.port)
    sock.sendall(b"GET /live HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n")  # a header line without its colon
    err = assert_openai_error(read_reply(sock), 400)
    assert err["code"] == "invalid_http_request"
    assert closed_within(sock, HANG_S)
    sock.close()
    assert status_count(server, "400") == before + 1
    still_serving(server)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize"])
@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "json"]
)
def test_a_body_not_sent_as_json_is_415(server, path, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(server.url + path, content=b'{"input": "x"}', headers=headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_is_accepted(server, content_type):
    r = httpx.post(
        server.url + "/tokenize", content=b'{"input": "x"}', headers={"Content-Type": content_type}
    )
    assert r.status_code == 200, r.text


def test_docs_can_be_switched_off(server):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"):
        assert httpx.get(server.url + path).status_code == 404, path


LAUNCH = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n}))
from embed_service.cli import main
sys.exit(main(sys.argv[1:]))
"""


class LaunchedServer(ServerProcess):
    """`ServerProcess`, started through `LAUNCH` so that the server runs under a low open-file limit."""

    def __init__(self, nofile: int, *args: str):  # what ServerProcess.__init__ does, with another command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="embed-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH.format(n=nofile), "serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
            start_new_session=True,
        )
        ServerProcess.running.add(self)  # killed however the test ends


def test_a_low_open_file_limit_is_said_and_the_connection_limit_fits_it():
    nofile = 300
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < nofile:
        pytest.skip(f"this machine's open-file hard limit ({hard}) is below the {nofile} this test sets")
    with LaunchedServer(nofile, "--max-connections", "1024", "--header-timeout", "10") as s:
        log = s.output()
        assert "open-file limit" in log and "serving at most" in log, log
        fitted = int(log.split("serving at most ")[1].split()[0])
        assert 0 < fitted < nofile
        idle = [connect(s.port) for _ in range(fitted)]
        try:
            late = connect(s.port)
            late.sendall(head("GET", "/live"))
            assert_openai_error(read_reply(late), 503)  # answered, not a failed connect
            late.close()
        finally:
            for sock in idle:
                sock.close()
