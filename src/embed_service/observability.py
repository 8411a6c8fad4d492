"""Log format and request tracing: one logging set-up for the server's and uvicorn's lines, and the
OpenTelemetry spans of the engine (tokenization, queue wait, inference).

Below the engine: it imports nothing of the project but its version, and no OpenTelemetry module until
tracing is switched on, so a server without ``--otlp-endpoint`` pays one ``is None`` test per span site.
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any, Protocol

import orjson

from embed_service import __version__

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# --- logs ---------------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC), level, logger, message, the record's ``fields`` (a dict
    passed as ``extra={"fields": ...}``) at the top level, and the traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The lines of ``logging.Formatter(TEXT_FORMAT)``, cheaper: the date and time are formatted once per
    second instead of once per record (strftime and localtime, ~2.5 us of every access line), and the
    line is one f-string instead of a %-format over the record's attributes."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")  # (whole second, its text): one tuple, safe across threads

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        whole = int(record.created)
        second, text = self._second
        if whole != second:
            text = time.strftime(self.default_time_format, self.converter(whole))
            self._second = (whole, text)
        return f"{text},{int(record.msecs):03d}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"{record.asctime} {record.levelname} {record.name}: {record.message}"


def logging_config(level: str, log_format: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` dict: one handler on the root logger, and uvicorn's loggers sending
    their lines to it (uvicorn's own configuration would give them handlers and a format of their own)."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"()": f"{__name__}.TextFormatter"}
    )
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,  # the modules' loggers exist already
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            name: {"handlers": [], "propagate": True, "level": level}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
        },
    }


def configure_logging(level: str, log_format: str) -> None:
    logging.config.dictConfig(logging_config(level, log_format))
    # Neither format shows where a line was logged from, nor the thread or process: records need not look
    # them up (the logging HOWTO's "Optimization"; a stack walk per line, ~2 us of every access line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.captureWarnings(True)  # Python warnings (torch's, say) in the same format, not bare stderr


# --- traces -------------------------------------------------------------------------------------

_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer: Any = None
_NO_SPAN = contextlib.nullcontext()


def setup_tracing(endpoint: str) -> None:
    """Send spans to an OTLP/HTTP collector at `endpoint` (its base URL; ``/v1/traces`` is added)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise SystemExit(
            "--otlp-endpoint needs the OpenTelemetry SDK and exporter: pip install 'embed-service[otel]'"
        ) from None
    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        # Neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names the service.
        resource = resource.merge(Resource({"service.name": "embed-service"}))
    provider = TracerProvider(resource=resource)  # flushes its batches at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    use_tracer_provider(provider)


def use_tracer_provider(provider: Any) -> None:
    """Trace with this SDK TracerProvider from now on (None: stop); before `create_app`, which hands it to
    FastAPI (api/access_log.py). The global provider is left alone, so a test can trace into its own
    exporter."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer("embed_service", __version__) if provider is not None else None


def tracer_provider() -> Any:
    return _provider


def current_span() -> Any:
    """The span of the request being served (the HTTP server span), or None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current one around a block; yields None (and costs nothing) when tracing is off."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name)


class _Ran(Protocol):  # batching/sequence.py BatchRun, read only
    @property
    def replica(self) -> int: ...
    @property
    def started_at(self) -> float: ...
    @property
    def finished_at(self) -> float: ...
    @property
    def sequences(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class _Traced(Protocol):  # batching/sequence.py Sequence, read only
    @property
    def enqueued_at(self) -> float: ...
    @property
    def ran(self) -> _Ran | None: ...


def trace_batches(seqs: Iterable[_Traced]) -> None:
    """Spans for a request's time in the batcher, from the times its sequences carry: one ``queue`` span
    (submitted -> its first batch starts) and one ``inference`` span per batch it ran in.

    The batcher runs on other tasks and threads and knows nothing of requests, so it only stamps the
    sequences; the spans are made here, afterwards, on the request's own context, with explicit times.
    """
    if _tracer is None:
        return
    runs: dict[int, list[Any]] = {}  # id(batch) -> [batch, this request's sequences in it]
    enqueued = None
    for s in seqs:  # a request admitted piecewise submits in parts: its queue span starts with the first
        enqueued = s.enqueued_at if enqueued is None else min(enqueued, s.enqueued_at)
        if s.ran is not None:
            runs.setdefault(id(s.ran), [s.ran, 0])[1] += 1
    if enqueued is None or not runs:
        return
    # time.perf_counter() seconds -> epoch nanoseconds, as OpenTelemetry wants them.
    offset = time.time_ns() - time.perf_counter_ns()

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    batches = sorted(runs.values(), key=lambda r: r[0].started_at)
    queue = _tracer.start_span("queue", start_time=ns(enqueued))
    queue.set_attribute("embed.sequences", sum(n for _, n in batches))
    queue.end(end_time=ns(batches[0][0].started_at))
    for ran, n in batches:
        inference = _tracer.start_span(
            "inference",
            start_time=ns(ran.started_at),
            attributes={
                "embed.replica": ran.replica,
                "embed.batch.sequences": ran.sequences,
                "embed.batch.tokens": ran.tokens,
                "embed.sequences": n,
            },
        )
        inference.end(end_time=ns(ran.finished_at))


def trace_id(span: Any) -> str:
    return format(span.get_span_context().trace_id, "032x")


def configure(level: str, log_format: str, otlp_endpoint: str | None) -> None:
    """The process-wide set-up, once, before anything logs: the log format, then tracing when asked."""
    configure_logging(level, log_format)
    if otlp_endpoint:
        setup_tracing(otlp_endpoint)
        logging.getLogger(__name__).info("tracing to %s", otlp_endpoint)
