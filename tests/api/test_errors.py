"""Every bad input gets a clear 4xx in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.server import HANG_S, ServerProcess, wait_until, workers_held

KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "--dtype", "float32", "--api-key", KEY, "--max-client-batch-size", "8", "--max-request-bytes", "4096"
    ) as s:
        yield s


def post(server, body=None, *, content=None, path="/v1/embeddings", headers=AUTH):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": 42}, "input"),
        ({"input": {"text": "x"}}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], "a"]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [True, False]}, "input"),
        ({"input": [1.5, 2.5]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 385}, "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "truncate": "yes"}, "truncate"),
        ({"input": "x", "truncation_direction": "middle"}, "truncation_direction"),
        ({"input": "x", "normalize": 1}, "normalize"),
        ({"input": ["x"] * 9}, "input"),  # past --max-client-batch-size 8
        ({"input": [[101, 30522, 102]]}, "input"),  # outside the vocabulary
        ({"input": [[101, -1, 102]]}, "input"),
        ({"input": "word " * 600, "truncate": False}, "input"),
    ],
)
def test_invalid_request_is_400(server, body, param):
    err = assert_error(post(server, body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_body_is_400(server, content):
    r = post(server, content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400)


def test_token_ids_past_the_max_length_with_truncation_off_are_400(server):
    assert_error(post(server, {"input": [[101] + [2000] * 300 + [102]], "truncate": False}), 400, "input")
    assert post(server, {"input": [[101] + [2000] * 300 + [102]]}).status_code == 200  # truncated by default


def test_auth(server):
    assert_error(post(server, {"input": "x"}, headers={}), 401)
    assert_error(post(server, {"input": "x"}, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert post(server, {"input": "x"}).status_code == 200
    for open_path in ("/live", "/health", "/metrics"):
        assert httpx.get(server.url + open_path).status_code == 200


def test_unknown_model_is_404(server):
    err = assert_error(post(server, {"input": "x", "model": "gpt-4"}), 404, "model")
    assert "all-MiniLM-L6-v2" in err["message"]
    assert_error(post(server, {"input": ["x"], "model": "nope"}, path="/tokenize"), 404, "model")


def test_unknown_route_is_404_and_wrong_method_is_405(server):
    assert_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)
    assert_error(httpx.get(server.url + "/v1/embeddings", headers=AUTH), 405)
    assert_error(httpx.put(server.url + "/tokenize", headers=AUTH, json={}), 405)


def test_oversized_body_is_413(server):
    body = {"input": ["x" * 5000]}
    assert_error(post(server, body), 413)
    # Without a Content-Length header (chunked), the limit holds while reading.
    chunks = iter([b'{"input": ["', b"y" * 3000, b"z" * 3000, b'"]}'])
    r = httpx.post(
        server.url + "/v1/embeddings", content=chunks, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_error(r, 413)


def test_never_422_and_server_keeps_serving(server):
    """Random malformed bodies: all answered 200 or 400, never a raw FastAPI 422 or a 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-5, 40000)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=8,
    )
    bodies = st.fixed_dictionaries(
        {},
        optional={
            "input": values,
            "model": values,
            "encoding_format": values,
            "dimensions": values,
            "truncate": values,
            "normalize": values,
        },
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(body):
        r = post(server, body)
        assert r.status_code in (200, 400, 404), r.text
        if r.status_code != 200:
            assert_error(r, r.status_code)

    check()
    assert post(server, {"input": "still serving"}).status_code == 200


def in_flight(server) -> float:
    """Inputs admitted and not yet answered."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("embed_inputs_in_flight{")
    )


def test_429_past_max_concurrent_requests_with_retry_after():
    # A 64-input request is admitted piecewise: it keeps the limit of 16 full until its last 16 inputs are
    # in (no capacity reserved for interactive requests here: tests/engine/test_admission.py covers that).
    # The workers are held while it is admitted, so the limit is full when "one more" comes, on any CPU.
    with ServerProcess(
        "--dtype",
        "float32",
        "--max-concurrent-requests",
        "16",
        "--max-client-batch-size",
        "64",
        "--interactive-reserved-inputs",
        "0",
    ) as s:
        big = {"input": ["a long input to keep the worker busy " * 10] * 64}
        done: dict = {}
        t = threading.Thread(
            target=lambda: done.setdefault("r", httpx.post(s.url + "/v1/embeddings", json=big, timeout=300))
        )
        with workers_held(s):
            t.start()
            wait_until(lambda: in_flight(s) >= 16, "the limit to be full", s)
            rejected = httpx.post(s.url + "/v1/embeddings", json={"input": "one more"}, timeout=60)
        t.join()
        err = assert_error(rejected, 429)
        assert err["type"] == "rate_limit_error"
        assert int(rejected.headers["Retry-After"]) >= 1
        assert done["r"].status_code == 200 and len(done["r"].json()["data"]) == 64
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "after"}).status_code == 200


def test_every_503_carries_retry_after():
    # Was: a request was left to run "long enough" (0.2 s) for the probes to find the drain in progress; on
    # a faster CPU it finished first, the drain ended and the probe got "connection refused". Now the
    # workers are held, so the admitted request is in flight until the probes are answered.
    with ServerProcess("--dtype", "float32") as s:
        request = {"input": ["an input in flight while the server drains"] * 4}
        done: dict = {}
        t = threading.Thread(
            target=lambda: done.setdefault(
                "r", httpx.post(s.url + "/v1/embeddings", json=request, timeout=300)
            )
        )
        with workers_held(s):
            t.start()
            wait_until(lambda: in_flight(s) > 0, "the request to be admitted", s)
            s.proc.send_signal(signal.SIGTERM)  # drains: the request is finished, nothing new admitted
            wait_until(lambda: "received SIGTERM: draining" in s.output(), "the drain to begin", s)
            refused = post(s, {"input": "during the drain"}, headers={})
            health = httpx.get(s.url + "/health")
        t.join()
        assert done["r"].status_code == 200, "the drain finishes what it admitted"
        err = assert_error(refused, 503)
        assert err["type"] == "service_unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert int(health.headers["Retry-After"]) >= 1
        assert s.proc.wait(HANG_S) == 0
