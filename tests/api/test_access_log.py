"""One access line per request, in one log format with uvicorn's own lines; X-Request-Id taken or made,
and echoed in the response and the line."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from embed_service.api.app import create_app
from embed_service.config import Settings
from embed_service.engine.engine import Engine
from embed_service.models.spec import load_spec
from embed_service.server import local_plan
from tests.server import ServerProcess, wait_until, workers_held

GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--log-format", "json", "--dtype", "float32", "--log-level", "debug") as s:
        yield s


def log_lines(server: ServerProcess) -> list[dict]:
    server.log.flush()
    with open(server.log.name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def in_flight(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("embed_inputs_in_flight{"))


def access_lines(server: ServerProcess, request_id: str, timeout: float = 10.0) -> list[dict]:
    """The access lines with this request id (the line is written as the response goes out: wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            line
            for line in log_lines(server)
            if line["logger"] == "embed_service.access" and line.get("request_id") == request_id
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_every_line_is_json_uvicorn_included(server):
    httpx.get(server.url + "/v1/models", timeout=10)
    lines = log_lines(server)  # json.loads of every line: none is in another format
    loggers = {line["logger"] for line in lines}
    assert "uvicorn.error" in loggers, loggers  # "Started server process", "Uvicorn running on ..."
    assert {"embed_service.access", "embed_service.engine.engine"} <= loggers
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line)


def test_embeddings_line_reports_the_request(server):
    texts = ["a first sentence to embed", "and a second, somewhat longer sentence to embed"]
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": texts},
        headers={"X-Request-Id": "client-id_42.a:b"},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "client-id_42.a:b"
    [line] = access_lines(server, "client-id_42.a:b")
    assert line["level"] == "INFO"
    assert line["method"] == "POST" and line["path"] == "/v1/embeddings" and line["status"] == 200
    assert line["inputs"] == 2
    assert line["tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["model"] == r.json()["model"] == "all-MiniLM-L6-v2"
    assert line["duration_ms"] > 0
    assert "POST /v1/embeddings 200" in line["message"] and "request_id=client-id_42.a:b" in line["message"]


def test_tokenize_line_counts_the_tokens(server):
    r = httpx.post(server.url + "/tokenize", json={"input": ["one two", "three"]}, timeout=30)
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert GENERATED.fullmatch(rid)
    [line] = access_lines(server, rid)
    assert line["inputs"] == 2
    assert line["tokens"] == sum(d["count"] for d in r.json()["data"])


@pytest.mark.parametrize(
    "sent",
    ["x" * 129, "has space", "semi;colon", 'quote"d', "ünïcode", "new%0Aline", ""],
)
def test_unsafe_request_id_is_replaced(server, sent):
    r = httpx.post(
        server.url + "/tokenize", json={"input": "hi"}, headers={"X-Request-Id": sent.encode()}, timeout=30
    )
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid != sent and GENERATED.fullmatch(rid)
    assert len(access_lines(server, rid)) == 1


def test_longest_safe_request_id_is_kept(server):
    sent = "A1-._:+/=" * 14 + "ab"  # 128 characters
    r = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": sent}, timeout=10)
    assert r.headers["x-request-id"] == sent


def test_generated_ids_differ(server):
    ids = {httpx.get(server.url + "/live", timeout=10).headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("POST", "/v1/embeddings", {"input": []}, 400),
        ("POST", "/v1/embeddings", {"input": "x", "model": "nope"}, 404),
        ("GET", "/no/such/route", None, 404),
        ("GET", "/v1/embeddings", None, 405),
    ],
)
def test_errors_carry_the_request_id(server, method, path, body, status):
    rid = f"err-{status}-{method}{path}"  # one id per case: two cases answer 404
    r = httpx.request(method, server.url + path, json=body, headers={"X-Request-Id": rid}, timeout=30)
    assert r.status_code == status
    assert r.headers["x-request-id"] == rid
    assert r.json()["error"]["message"]
    assert [(line["path"], line["status"]) for line in access_lines(server, rid)] == [(path, status)]


def test_probes_are_debug_level(server):
    r = httpx.get(server.url + "/health", headers={"X-Request-Id": "probe-1"}, timeout=10)
    assert r.status_code == 200
    [line] = access_lines(server, "probe-1")
    assert line["level"] == "DEBUG"  # shown here because this server runs at --log-level debug


def test_control_characters_in_the_path_are_escaped(server):
    httpx.get(server.url + "/x%0Aforged%20line", headers={"X-Request-Id": "path-1"}, timeout=10)
    [line] = access_lines(server, "path-1")
    assert line["path"] == "/x%0Aforged%20line"
    assert "\n" not in line["message"]


def test_client_that_disconnects_gets_one_line_and_no_traceback(server):
    # The workers are held while the client hangs up: its work is unanswered then, on any CPU (was: enough
    # work to outlast a 1 s sleep).
    body = json.dumps({"input": ["a fairly long sentence about nothing at all " * 40] * 512}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: gone-1\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with workers_held(server):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + body)
            wait_until(lambda: in_flight(server) > 0, "the request to be admitted", server)
        [line] = access_lines(server, "gone-1", timeout=60)
    assert line["status"] == 499
    assert line["inputs"] == 512
    # The server keeps serving. Its answer comes after the batch held at the cut has been computed and
    # dropped, so whatever that logs is in the log once this request's own line is.
    r = httpx.post(
        server.url + "/v1/embeddings", json={"input": "still here"}, headers={"X-Request-Id": "after-gone-1"}
    )
    assert r.status_code == 200
    assert access_lines(server, "after-gone-1")
    assert not [
        entry for entry in log_lines(server) if "exception" in entry or "Traceback" in entry["message"]
    ]


def test_unhandled_error_is_a_500_with_the_request_id_and_one_logged_traceback(default_model_path, caplog):
    settings = Settings(dtype="float32")
    engines = [Engine(settings, load_spec(default_model_path, None), ["m"])]
    app = create_app(settings, engines, local_plan(engines))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    with caplog.at_level("INFO"):
        # No lifespan (no `with`): this route needs no model. The server's exception handling is not
        # involved: the middleware answers before the exception could reach it.
        r = TestClient(app, raise_server_exceptions=True).get("/boom", headers={"X-Request-Id": "boom-1"})
    assert r.status_code == 500
    assert r.headers["x-request-id"] == "boom-1"
    assert r.json()["error"] == {
        "message": "internal error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "request_id=boom-1" in tracebacks[0].getMessage()
    [access] = [rec for rec in caplog.records if rec.name == "embed_service.access"]
    assert access.fields["status"] == 500 and access.fields["request_id"] == "boom-1"


def test_text_format_is_shared_by_uvicorn_and_the_server():
    code = (
        "import logging; from embed_service.observability import configure_logging; "
        "configure_logging('info', 'text'); "
        "logging.getLogger('uvicorn.error').info('from uvicorn'); "
        "logging.getLogger('embed_service.x').info('from the server'); "
        "logging.getLogger('embed_service.x').debug('not shown at info')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stderr.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    assert len(lines) == 2, lines
    assert re.fullmatch(stamp + r"uvicorn\.error: from uvicorn", lines[0])
    assert re.fullmatch(stamp + r"embed_service\.x: from the server", lines[1])
