"""One access log line per request, the request id, the request's attributes on its trace span, and the
request metrics (responses by status, the API routes' durations).

The request id is the client's ``X-Request-Id`` when it is short and plain (so it cannot forge log lines),
else a new one; it goes back in the response headers, on errors too, and into the log line and the span.
The routes leave what the line reports (model, inputs, tokens) in the request's ``scope["state"]``.
All of it is one pure-ASGI layer: every layer a request passes costs it a coroutine and a wrapped `send`.
The HTTP server span itself is FastAPI's (its native OpenTelemetry support: semantic-convention
attributes, ``traceparent`` propagation); this module only hands FastAPI the tracer provider.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from typing import Any
from urllib.parse import quote

from fastapi.telemetry import TelemetryConfig
from starlette.types import Message, Receive, Scope, Send

from embed_service import metrics, observability
from embed_service.api.errors import APIError, error_response

log = logging.getLogger("embed_service.access")
errors_log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")
# Probes and scrapes come every few seconds and say nothing the server does not log otherwise (loading,
# draining and failures have lines of their own): their lines are debug level, and they are not counted in
# embed_requests_total, whose 5xx share is an alert (the 503s of /health while loading are no error).
QUIET_PATHS = frozenset({"/health", "/live", "/metrics"})
# The routes whose durations embed_request_duration_seconds records.
TIMED_PATHS = frozenset(
    {"/v1/embeddings", "/embeddings", "/tokenize", "/v2/embed", "/v1/embed"}
    | {"/rerank", "/v1/rerank", "/v2/rerank", "/classify"}
)


class _Ids:
    """Generated request ids: 32 hex digits, a random 64-bit prefix per process (drawn again in a forked
    child) and a 64-bit counter, so unique across the server's processes and restarts without a system
    call per request (os.urandom was one)."""

    def __init__(self) -> None:
        self.renew()
        os.register_at_fork(after_in_child=self.renew)

    def renew(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.count = itertools.count(int.from_bytes(os.urandom(4), "big"))

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.count) & 0xFFFFFFFFFFFFFFFF:016x}"


new_request_id = _Ids()


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when it is 1-128 characters of [A-Za-z0-9._:+/=-], else a new one of 32
    hex digits, unique across the server's processes."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if SAFE_REQUEST_ID.fullmatch(text):
                return text
            break
    return new_request_id()


def note(request: Any, **fields: Any) -> None:
    """Record what the access line and the span report about a request (model, inputs, tokens)."""
    request.scope.setdefault("state", {}).update(fields)


def telemetry_config() -> TelemetryConfig:
    """FastAPI's OpenTelemetry settings: the HTTP server span with our provider when tracing is on (probes
    and scrapes excepted), nothing otherwise. FastAPI's own metrics and log events stay off: the metrics
    are Prometheus's (metrics.py) and the log lines are these."""
    provider = observability.tracer_provider()
    off: TelemetryConfig = {"metrics": False, "logs": False, "operation_spans": False}
    if provider is None:
        return {**off, "tracing": False}
    return {**off, "tracer_provider": provider, "exclude": _untraced}


def _untraced(scope: Any) -> bool:
    return scope.get("path") in QUIET_PATHS  # a trace of every probe and scrape would bury the requests'


class AccessLogMiddleware:
    """Pure ASGI (no body buffering). The app's only middleware of its own, so the line, the header and the
    metrics cover every response the app makes, including the 500 of an unhandled exception, which it
    answers itself (after logging the traceback once, with the request id) instead of letting it reach the
    server. The metrics count the status the line reports (499 for a request cancelled unanswered)."""

    def __init__(self, app: Any, default_model: str):
        self.app = app
        self.default_model = default_model
        # The metrics' children by label values: `labels()` validates and locks on every call.
        self._responses: dict[tuple[str, int], Any] = {}
        self._durations: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = request_id(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        span = observability.current_span()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, rid.encode())]
                message = {**message, "headers": headers}
                if span is not None:  # before the response ends it, with what the route recorded
                    span.set_attributes(span_attributes(state))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status is not None:
                raise  # the response has begun: nothing can be answered any more
            errors_log.exception(
                "unhandled error on %s %s request_id=%s", scope["method"], printable(scope["path"]), rid
            )
            if span is not None:
                span.record_exception(exc)
            await error_response(APIError(500, "internal error", "server_error"))(
                scope, receive, send_with_id
            )
        except asyncio.CancelledError:
            status = status or 499  # stopped before an answer: nobody got one
            raise
        finally:
            seconds = time.perf_counter() - start
            self._count(scope, status or 500, seconds, state)
            access_line(scope, status or 500, seconds, state, span)

    def _count(self, scope: Scope, status: int, seconds: float, state: dict) -> None:
        if scope["path"] in QUIET_PATHS:
            return
        model = state.get("model", self.default_model)
        counter = self._responses.get((model, status))
        if counter is None:
            counter = self._responses[model, status] = metrics.REQUESTS.labels(model, str(status))
        counter.inc()
        if scope["path"] in TIMED_PATHS:
            duration = self._durations.get(model)
            if duration is None:
                duration = self._durations[model] = metrics.REQUEST_DURATION.labels(model)
            duration.observe(seconds)


def printable(path: str) -> str:
    """The server percent-decodes the path: encode it again, so no control character reaches a line."""
    return quote(path, safe="/:@!$&'()*+,;=-._~")


def span_attributes(state: dict) -> dict[str, Any]:
    attributes: dict[str, Any] = {"embed.request_id": state["request_id"]}
    if state.get("model") is not None:
        attributes["gen_ai.request.model"] = state["model"]
    if state.get("inputs") is not None:
        attributes["embed.inputs"] = state["inputs"]
    if state.get("tokens") is not None:
        attributes["gen_ai.usage.input_tokens"] = state["tokens"]
    return attributes


def access_line(scope: Scope, status: int, seconds: float, state: dict, span: Any) -> None:
    path = scope["path"]
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
    if not log.isEnabledFor(level):
        return
    path = printable(path)
    fields: dict[str, Any] = {
        "method": scope["method"],
        "path": path,
        "status": status,
        "duration_ms": round(seconds * 1000, 2),
        "inputs": state.get("inputs"),
        "tokens": state.get("tokens"),
        "model": state.get("model"),
        "request_id": state["request_id"],
    }
    if span is not None:
        fields["trace_id"] = observability.trace_id(span)
    text = f"{fields['method']} {path} {status} {seconds * 1000:.1f}ms " + " ".join(
        f"{k}={'-' if fields[k] is None else fields[k]}"
        for k in ("inputs", "tokens", "model", "request_id", "trace_id")
        if k in fields
    )
    log.log(level, text, extra={"fields": fields})  # no args: the text is not %-formatted again
