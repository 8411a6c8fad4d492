"""The HTTP-layer limits uvicorn lacks, on its httptools protocol (the fast one it picks by itself).

uvicorn bounds neither the size of a request head nor the time to receive it or its body: a client that
sends a header byte every half second, declares a body and never sends it, or opens a connection and says
nothing, holds a connection (and a file descriptor) for ever, and a 200 MB header is buffered whole. Its
`limit_concurrency` answers 503 in plain text without `Retry-After`, and past the open-file limit new
clients fail with nothing said. This module adds, per connection:

- a head larger than ``max_header_bytes`` (request line and headers): 431, connection closed;
- a head not received within ``header_timeout`` (from the connection's opening, or on a kept-alive
  connection from the head's first byte): connection closed, with a 408 when part of a head came;
- a body not received within ``body_timeout`` of its head: the app answers 408 (`read_json`); this module
  closes the connection one second later in case nothing is reading the body any more;
- ``keep_alive_timeout`` between requests (uvicorn's timer, also re-armed after a request whose answer
  went out before its body was in);
- past ``max_connections`` open connections, a request gets 503 in the API's error shape with
  ``Retry-After`` and its connection is closed; the limit is fitted to the open-file limit at start-up,
  and with several front-end processes counts the connections of all of them (``server_wide``).

It also tells a request's route when its client goes away (``DISCONNECT_HOOKS``): the callbacks a route
puts in its scope's ``extensions`` are called when the connection is lost before the answer is complete,
so a route stops its work without a task of its own waiting on ``receive()`` (`routes.until_disconnect`).

It reads and sets private state of uvicorn's protocol (the request cycle, the pipeline, the keep-alive
timer): pyproject.toml bounds uvicorn to the releases tests/api/test_uvicorn_contract.py passes on.

Each of these answers is counted in ``embed_requests_total`` under the default model, as the app counts a
request that names none, so a dashboard's error rate sees the clients refused before any route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from embed_service import metrics
from embed_service.api.errors import RETRY_AFTER, APIError, error_body, unavailable
from embed_service.config import ServerSettings

log = logging.getLogger(__name__)

FD_RESERVE = 128  # descriptors the process keeps for itself: listener, worker pipes, model files, the loop
BODY_GRACE_S = 1.0  # the app answers 408 at body_timeout; the connection is closed this much later
# A connection past the limit holds a file descriptor only this long for its head (then gets its 503), so a
# flood of connections cannot pile up past the limit for the whole header timeout.
OVER_LIMIT_HEAD_S = 1.0
# The scope extension (a list of callables) a route adds to, to be called if its client goes away first.
DISCONNECT_HOOKS = "embed.disconnect_hooks"


def disconnect_hooks(scope: Any) -> list[Callable[[], None]] | None:
    """The request's disconnect hooks; None where the server is not ours (no such extension)."""
    hooks: list[Callable[[], None]] | None = scope.get("extensions", {}).get(DISCONNECT_HOOKS)
    return hooks


@dataclass(frozen=True)
class HttpLimits:
    """The per-connection limits (the settings of the same names)."""

    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float
    max_connections: int


class Throttled:
    """Logs one line per `every` seconds at most, counting what it left out (a flood logs a few lines)."""

    def __init__(self, level: int, every: float = 10.0):
        self.level, self.every = level, every
        self.next_at = 0.0
        self.skipped = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.skipped += 1
            return
        more = f" (and {self.skipped} more like it in the last {self.every:g} s)" if self.skipped else ""
        log.log(self.level, message + more, *args)
        self.next_at, self.skipped = now + self.every, 0


# One per kind, so that each line's count is of its own kind.
_log_invalid = Throttled(logging.WARNING)
_log_large_head = Throttled(logging.WARNING)
_log_too_many = Throttled(logging.WARNING)
_log_slow_head = Throttled(logging.INFO)
_log_silent = Throttled(logging.INFO)
_log_slow_body = Throttled(logging.INFO)


def _json_headers(body: bytes, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *extra,
    ]


def too_many_connections_app(limit: int) -> Any:
    """The ASGI app that answers a request on a connection past the limit."""
    body = error_body(unavailable(f"more than {limit} open connections", "too_many_connections"))
    headers = _json_headers(body, [(k.lower().encode(), v.encode()) for k, v in RETRY_AFTER.items()])

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a request that was refused."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded head, deadlines on head and body, and a connection limit."""

    limits: ClassVar[HttpLimits]
    too_many: ClassVar[Any]
    model: ClassVar[str]  # the label its refusals are counted under

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout  # type: ignore[assignment]
        self.limit_concurrency = None  # checked here instead, and answered in the API's error shape
        self._head_bytes = 0  # of the head being received
        self._awaiting_head = True
        # At most one deadline (head or body) per connection; uvicorn keeps its own keep-alive timer.
        self._deadline: float | None = None  # time.monotonic() when `_on_deadline` is due; None: none
        self._on_deadline: Any = None
        self._timer: asyncio.TimerHandle | None = None  # fires at `_timer_at`, at or before the deadline
        self._timer_at = 0.0
        self._refused = False
        self._over_limit = False

    # The deadline moves on every request (head, then body, then none), but the loop's timer is moved
    # only when the new deadline is earlier than it: a timer that fires early re-arms itself for what is
    # left. A kept-alive connection then sets no timer per request (two set and two cancelled before,
    # ~5 us of a short request's CPU with uvloop). Deadlines are on time.monotonic(), not loop.time():
    # uvloop's clock is a coarse one in whole milliseconds, behind the real time by up to about one, so a
    # deadline on it could fall due a fraction of a millisecond before the stated seconds have passed.
    def _arm(self, seconds: float, callback: Any) -> None:
        deadline = time.monotonic() + seconds
        self._deadline, self._on_deadline = deadline, callback
        if self._timer is None or self._timer_at > deadline:
            self._schedule(deadline)

    def _disarm(self) -> None:
        self._deadline = self._on_deadline = None

    def _schedule(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = (
            self.loop.call_later(max(0.0, at - time.monotonic()), self._timer_fired),
            at,
        )

    def _timer_fired(self) -> None:
        self._timer = None
        if self._deadline is None:
            return
        if time.monotonic() < self._deadline:  # early (a moved deadline, or the loop's coarse clock)
            self._schedule(self._deadline)
            return
        callback = self._on_deadline
        self._disarm()
        callback()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._over_limit = self._open_connections() > self.limits.max_connections
        timeout = self.limits.header_timeout
        if self._over_limit:
            timeout = min(timeout, OVER_LIMIT_HEAD_S)
        self._arm(timeout, self._head_timed_out)  # a connection that says nothing

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cycle = self.cycle
        super().connection_lost(exc)
        # The request being answered (uvicorn marks only this one disconnected, as its receive() says).
        if cycle is not None and not cycle.response_complete:
            for hook in list(disconnect_hooks(cycle.scope) or ()):
                hook()

    def _open_connections(self) -> int:
        """Open connections, this one included, counted against `max_connections`: this process's (with
        several front-end processes, all of theirs together: `server_wide`)."""
        return len(self.connections)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            if self._deadline is None:  # the first byte of a head on a kept-alive connection
                self._arm(self.limits.header_timeout, self._head_timed_out)
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self._refused:
                _log_invalid("invalid HTTP request from %s", self._peer())
                self._refuse(400, "invalid HTTP request", "invalid_http_request")
            return
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
            return
        # A head still incomplete after this many bytes will not fit: refuse it before buffering more.
        if self._awaiting_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse_large_head()

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse_large_head()
            raise _Refused  # stops the parser; data_received sees the refusal
        self._awaiting_head = False
        self._head_bytes = 0
        self._arm(self.limits.body_timeout + BODY_GRACE_S, self._body_timed_out)
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[DISCONNECT_HOOKS] = []
        if not self._over_limit:
            super().on_headers_complete()
            return
        _log_too_many("more than %d open connections: answering 503", self.limits.max_connections)
        self._count(503)
        real, self.app = self.app, self.too_many
        try:
            super().on_headers_complete()
        finally:
            self.app = real

    def on_message_complete(self) -> None:
        self._disarm()
        self._awaiting_head = True
        super().on_message_complete()
        cycle = self.cycle
        # The body is all in: read on, so that a client that hangs up is seen (connection_lost, the
        # disconnect hooks) though the app will not call receive() again. A large body paused the reading
        # (uvicorn's high-water mark) and only receive() resumes it. Not for a pipelined request, which
        # waits for the one in progress with the reading paused.
        if cycle is not None and not cycle.response_complete and not self.pipeline:
            self.flow.resume_reading()
        # Answered before its body was in (401, 413, 415): the body's bytes cancelled uvicorn's keep-alive
        # timer, and the answer's completion, which arms it, has passed.
        if (
            cycle is not None
            and cycle.response_complete
            and not self.pipeline
            and self.timeout_keep_alive_task is None
            and not self.transport.is_closing()
        ):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self._head_bytes:
            _log_slow_head(
                "%s sent no complete request head within %g s: 408", self._peer(), self.limits.header_timeout
            )
            self._refuse(
                408,
                f"the request head was not received within {self.limits.header_timeout:g} s",
                "request_timeout",
            )
        else:
            _log_silent("closed a connection that sent nothing within %g s", self.limits.header_timeout)
            self.transport.close()

    def _body_timed_out(self) -> None:
        if not self.transport.is_closing():
            _log_slow_body(
                "%s sent no complete body within %g s: closed", self._peer(), self.limits.body_timeout
            )
            self.transport.close()

    def _refuse_large_head(self) -> None:
        _log_large_head("request head from %s over %d bytes: 431", self._peer(), self.limits.max_header_bytes)
        self._refuse(
            431,
            f"the request head is larger than the limit of {self.limits.max_header_bytes} bytes",
            "request_header_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer from here (no app involved) and close; a response still in progress is cut instead."""
        self._refused = True
        self._disarm()
        self._count(status)
        if self.cycle is None or self.cycle.response_complete:
            body = error_body(APIError(status, message, "invalid_request_error", code=code))
            headers = [*self.server_state.default_headers, *_json_headers(body, [])]
            head = b"".join(n + b": " + v + b"\r\n" for n, v in headers)
            self.transport.write(STATUS_LINE[status] + head + b"\r\n" + body)
        self.transport.close()

    def _count(self, status: int) -> None:
        metrics.REQUESTS.labels(self.model, str(status)).inc()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def server_wide(protocol: type, count: Any) -> type:
    """The HTTP protocol class with `--max-connections` counted over every front end (the docs' "server
    setting"): one count in shared memory, raised as a connection opens, lowered as it closes, so the limit
    is the server's whichever front end accepts a connection (the kernel may give a burst to one)."""

    class ServerWide(protocol):
        _open = 0  # the count as this connection opened, itself included; 0: not counted

        def connection_made(self, transport: Any) -> None:
            with count.get_lock():
                count.value += 1
                self._open = count.value
            super().connection_made(transport)

        def _open_connections(self) -> int:
            return self._open

        def connection_lost(self, exc: Exception | None) -> None:
            if self._open:
                self._open = 0
                with count.get_lock():
                    count.value -= 1
            super().connection_lost(exc)

    return ServerWide


def protocol_class(limits: HttpLimits, model: str) -> type[LimitedHttpToolsProtocol]:
    too_many = staticmethod(too_many_connections_app(limits.max_connections))
    return type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {"limits": limits, "too_many": too_many, "model": model},
    )


def fit_connections(max_connections: int) -> int:
    """Raise the open-file soft limit to what `max_connections` needs (up to the hard limit); where it
    cannot go that high, serve fewer connections and say so, so a client past it gets 503, not a failed
    connect with nothing logged."""
    try:
        import resource
    except ImportError:  # pragma: no cover (not a POSIX system)
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    infinite = resource.RLIM_INFINITY
    target = need if hard == infinite else min(need, hard)
    if soft != infinite and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info(
                "open-file limit raised from %d to %d for --max-connections %d", soft, target, max_connections
            )
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d: %s", soft, exc)
    if soft != infinite and soft < need:
        fitted = max(1, soft - FD_RESERVE)
        log.warning(
            "the open-file limit (ulimit -n) is %d (hard limit %d): room for %d connections, not the %d of "
            "--max-connections; serving at most %d (raise the limit to %d to serve them all)",
            soft,
            hard,
            fitted,
            max_connections,
            fitted,
            need,
        )
        return fitted
    return max_connections


def uvicorn_options(settings: ServerSettings, model: str) -> dict[str, Any]:
    """The `uvicorn.Config` arguments that set the HTTP protocol and its limits (`model`: the default
    model's name, which its refusals are counted under)."""
    limits = HttpLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        keep_alive_timeout=settings.keep_alive_timeout,
        max_connections=fit_connections(settings.max_connections),
    )
    return {"http": protocol_class(limits, model), "ws": "none", "limit_concurrency": None}
