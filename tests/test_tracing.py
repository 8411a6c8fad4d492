"""OpenTelemetry tracing: a span per request with children for tokenization, queue wait and inference.

In process, the app from `create_app` with a real engine (worker processes on the packaged model) traces
into the SDK's in-memory exporter; a live server with --otlp-endpoint sends the same tree to a collector
stand-in over OTLP/HTTP.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from embed_service import observability
from embed_service.config import Settings
from tests.server import ServerProcess, free_port, in_process_app

MODEL = "all-MiniLM-L6-v2"
CLOCK_SLACK_NS = 1_000_000  # queue and inference times come from perf_counter, converted: 1 ms either way


@pytest.fixture(scope="module")
def traced(default_model_path) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observability.use_tracer_provider(provider)
    try:
        # 256 tokens a batch: the model's max input length, so two long inputs never share a batch.
        settings = Settings(dtype="float32", max_batch_tokens=256)
        with in_process_app(settings, default_model_path, MODEL) as client:
            yield client, exporter
    finally:
        observability.use_tracer_provider(None)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def traceparent(n: int) -> tuple[str, str, int, int]:
    """A W3C traceparent for a client trace of its own per test: (header, request id, trace id, parent)."""
    trace_id, parent = int(TRACE_ID, 16) + n, 0x00F067AA0BA902B7 + n
    return f"00-{trace_id:032x}-{parent:016x}-01", f"req-{n}", trace_id, parent


def request_spans(exporter: InMemorySpanExporter, trace_id: int) -> tuple[ReadableSpan, list[ReadableSpan]]:
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    [server] = [s for s in spans if s.kind == SpanKind.SERVER]
    children = [s for s in spans if s is not server]
    for child in children:
        assert child.parent is not None and child.parent.span_id == server.context.span_id, child.name
        assert server.start_time - CLOCK_SLACK_NS <= child.start_time <= child.end_time
        assert child.end_time <= server.end_time + CLOCK_SLACK_NS
    return server, children


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time)


def test_embeddings_request_span_and_its_children(traced):
    client, exporter = traced
    header, rid, trace_id, parent = traceparent(1)
    texts = ["the first text", "a second, longer text to embed", "third"]
    r = client.post(
        "/v1/embeddings", json={"input": texts}, headers={"traceparent": header, "X-Request-Id": rid}
    )
    assert r.status_code == 200
    tokens = r.json()["usage"]["prompt_tokens"]
    server, children = request_spans(exporter, trace_id)

    # The request span continues the client's trace, with the HTTP attributes and the request's own.
    assert server.parent is not None and server.parent.span_id == parent and server.parent.is_remote
    assert server.name == "POST /v1/embeddings"
    attrs = server.attributes or {}
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.route"] == "/v1/embeddings"
    assert attrs["url.path"] == "/v1/embeddings"
    assert attrs["http.response.status_code"] == 200
    assert attrs["embed.request_id"] == rid
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["embed.inputs"] == 3
    assert attrs["gen_ai.usage.input_tokens"] == tokens
    assert server.status.status_code == StatusCode.UNSET

    assert {s.name for s in children} == {"tokenize", "queue", "inference"}
    [tokenize] = by_name(children, "tokenize")
    assert tokenize.attributes == {"embed.inputs": 3, "embed.tokens": tokens}
    [queue] = by_name(children, "queue")
    inference = by_name(children, "inference")
    # Tokenized, then queued, then run: the queue wait ends where the first batch starts.
    assert tokenize.end_time <= queue.start_time + CLOCK_SLACK_NS
    assert queue.end_time == inference[0].start_time
    assert (queue.attributes or {})["embed.sequences"] == 3
    assert sum((s.attributes or {})["embed.sequences"] for s in inference) == 3
    # Nothing else was in flight: the batches carried this request's tokens only.
    assert sum((s.attributes or {})["embed.batch.tokens"] for s in inference) == tokens


def test_one_inference_span_per_batch(traced):
    client, exporter = traced
    header, _, trace_id, _ = traceparent(2)
    # Six inputs of about 200 tokens; 256 tokens a batch: six batches, one input each.
    texts = [f"{i} " + "word " * (190 + i) for i in range(6)]
    r = client.post("/v1/embeddings", json={"input": texts}, headers={"traceparent": header})
    assert r.status_code == 200
    tokens = r.json()["usage"]["prompt_tokens"]
    _, children = request_spans(exporter, trace_id)
    [queue] = by_name(children, "queue")
    inference = by_name(children, "inference")
    assert len(inference) == 6
    for span in inference:
        attrs = span.attributes or {}
        assert attrs["embed.batch.sequences"] == 1 and attrs["embed.sequences"] == 1
        assert 190 < attrs["embed.batch.tokens"] <= 256
    assert sum((s.attributes or {})["embed.batch.tokens"] for s in inference) == tokens
    assert queue.end_time == inference[0].start_time
    # A replica runs one batch at a time.
    for replica in {(s.attributes or {})["embed.replica"] for s in inference}:
        mine = [s for s in inference if (s.attributes or {})["embed.replica"] == replica]
        for a, b in zip(mine, mine[1:]):
            assert a.end_time <= b.start_time


def test_tokenize_route_has_only_the_tokenize_child(traced):
    client, exporter = traced
    header, rid, trace_id, _ = traceparent(3)
    r = client.post("/tokenize", json={"input": ["one two", "three"]}, headers={"traceparent": header})
    assert r.status_code == 200
    server, children = request_spans(exporter, trace_id)
    assert server.name == "POST /tokenize"
    assert [s.name for s in children] == ["tokenize"]
    counted = sum(d["count"] for d in r.json()["data"])
    assert (server.attributes or {})["gen_ai.usage.input_tokens"] == counted
    assert (children[0].attributes or {})["embed.tokens"] == counted


@pytest.mark.parametrize(
    "body, status", [({"input": []}, 400), ({"input": "x", "model": "nope"}, 404)], ids=["400", "404"]
)
def test_client_errors_are_recorded_not_marked_failed(traced, body, status):
    client, exporter = traced
    header, _, trace_id, _ = traceparent(10 + status)
    r = client.post("/v1/embeddings", json=body, headers={"traceparent": header})
    assert r.status_code == status
    server, children = request_spans(exporter, trace_id)
    assert (server.attributes or {})["http.response.status_code"] == status
    assert server.status.status_code == StatusCode.UNSET  # a 4xx is the client's error, not the server's
    assert children == []
    assert (server.attributes or {})["embed.request_id"] == r.headers["x-request-id"]


def test_probes_and_scrapes_are_not_traced(traced):
    client, exporter = traced
    before = len(exporter.get_finished_spans())
    for path in ("/health", "/live", "/metrics"):
        assert client.get(path).status_code == 200
    assert len(exporter.get_finished_spans()) == before
    assert client.get("/v1/models").status_code == 200
    assert [s.name for s in exporter.get_finished_spans()[before:]] == ["GET /v1/models"]


def test_without_tracing_no_sdk_is_loaded_and_no_span_is_made(default_model_path):
    code = f"""
import json, sys
from fastapi.testclient import TestClient
from embed_service import observability
from embed_service.api.access_log import telemetry_config
from embed_service.api.app import create_app
from embed_service.config import Settings
from embed_service.engine.engine import Engine
from embed_service.models.spec import load_spec
from embed_service.server import local_plan
settings = Settings()
engines = [Engine(settings, load_spec({str(default_model_path)!r}, None), ["m"])]
app = create_app(settings, engines, local_plan(engines))
r = TestClient(app).post("/tokenize", json={{"input": "hello"}})  # no lifespan: /tokenize needs no workers
print(json.dumps({{
    "status": r.status_code,
    "sdk": sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))),
    "telemetry": {{k: v for k, v in telemetry_config().items()}},
    "no_span": observability.span("x") is observability.span("y"),
}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["status"] == 200
    assert result["sdk"] == []
    assert result["telemetry"]["tracing"] is False
    assert result["no_span"]  # one shared no-op context, nothing allocated per span site


def test_otlp_endpoint_must_be_a_url():
    out = subprocess.run(
        [sys.executable, "-m", "embed_service", "serve", "--otlp-endpoint", "collector:4318"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--otlp-endpoint" in out.stderr and "http://" in out.stderr


def test_otlp_endpoint_without_the_extra_says_what_to_install():
    code = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None; "
        "from embed_service.observability import setup_tracing; setup_tracing('http://127.0.0.1:4318')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "pip install 'embed-service[otel]'" in out.stderr


class Collector(http.server.ThreadingHTTPServer):
    """Stands in for an OpenTelemetry collector: keeps what is posted to /v1/traces."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    collector.requests.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)

    def spans(self) -> list[tuple[str, object]]:
        return [
            (resource.resource, span)
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


def test_live_server_exports_over_otlp():
    with Collector() as collector:
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        # Export every 100 ms instead of every 5 s.
        with ServerProcess("--otlp-endpoint", endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as server:
            header, _, trace_id, _ = traceparent(4)
            r = httpx.post(
                server.url + "/v1/embeddings",
                json={"input": ["hello", "world"]},
                headers={"traceparent": header},
            )
            assert r.status_code == 200
            wanted = {"POST /v1/embeddings", "tokenize", "queue", "inference"}
            deadline = time.monotonic() + 30
            while True:
                mine = [
                    (res, s) for res, s in collector.spans() if int.from_bytes(s.trace_id, "big") == trace_id
                ]
                if {s.name for _, s in mine} >= wanted or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            log = server.output()
        collector.shutdown()
    assert {s.name for _, s in mine} >= wanted, [s.name for _, s in mine]
    # The access line names the trace.
    assert "POST /v1/embeddings 200" in log and f"trace_id={trace_id:032x}" in log
    [server_span] = [s for _, s in mine if s.name == "POST /v1/embeddings"]
    for _, s in mine:
        if s is not server_span:
            assert s.parent_span_id == server_span.span_id
    resource = {a.key: a.value.string_value for a in mine[0][0].attributes}
    assert resource["service.name"] == "embed-service"
