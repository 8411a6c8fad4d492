"""The channel between an HTTP front end and the engine process: typed messages over one Unix socket pair,
framed by `multiprocessing.connection` (the standard library's length-prefixed messages) and read and
written on threads of its own, so the event loop never blocks on the socket and two large messages
crossing cannot deadlock.

Why `multiprocessing.connection` and not ZMQ: the channel is one point-to-point pair per front end, on one
machine, between processes this server starts; ZMQ's routing, queues and reconnection buy nothing there and
would be a new dependency. The framing, the part that is easy to get wrong, is the standard library's.

Every message is one of the dataclasses below, pickled as plain data: strings, numbers, lists, dicts,
numpy arrays and the engine's own option and result dataclasses. An error goes as its kind, message and
param (`Err`), never as an exception object: `loads` refuses to build one, so a message that would carry
one is a protocol error, not a half-built exception in the front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from embed_service import observability
from embed_service.engine.errors import (
    DeviceMemoryError,
    EngineError,
    InvalidInputError,
    NotReadyError,
    OverloadedError,
)

log = logging.getLogger("embed_service")


# --- the messages ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """Front end -> engine: run `method` of `model`'s engine (None: the host itself) with `args`.
    `trace`: the caller's trace context (W3C headers), so the engine's spans join the request's tree."""

    id: int
    model: str | None
    method: str
    args: tuple
    trace: dict[str, str]


@dataclass(frozen=True, slots=True)
class Cancel:
    """Front end -> engine: the client went away; the engine's task for call `id` is cancelled."""

    id: int


@dataclass(frozen=True, slots=True)
class HttpSeries:
    """Front end -> engine: this front end's HTTP metric samples, cumulative (the answer to `Report`)."""

    samples: list[tuple[str, tuple, float]]


@dataclass(frozen=True, slots=True)
class Ok:
    """Engine -> front end: call `id` returned `value`."""

    id: int
    value: Any


@dataclass(frozen=True, slots=True)
class Err:
    """Engine -> front end: call `id` raised. `kind`: one of ERROR_KINDS; anything else is "internal"."""

    id: int
    kind: str
    message: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class State:
    """Engine -> front end: each model's (state, failure, /info), and the server's fatal failure if any."""

    models: dict[str, tuple[str, str | None, dict[str, Any]]]
    fatal: str | None


@dataclass(frozen=True, slots=True)
class Report:
    """Engine -> front end: send your `HttpSeries` (a /metrics scrape)."""


# --- errors as kind, message and param ------------------------------------------------------------------------

ERROR_KINDS: dict[str, type[EngineError]] = {
    "invalid_input": InvalidInputError,
    "overloaded": OverloadedError,
    "device_memory": DeviceMemoryError,
    "not_ready": NotReadyError,
}
INTERNAL = "internal"


def error_message(call_id: int, exc: BaseException) -> Err:
    """An engine's refusal as its kind, message and param; any other exception is "internal" (its text
    stays in the engine process's log: a client gets "internal error", as in one process)."""
    for kind, cls in ERROR_KINDS.items():
        if type(exc) is cls:
            return Err(call_id, kind, str(exc), exc.param)
    return Err(call_id, INTERNAL, "internal error")


def error_from(message: Err) -> EngineError:
    """The exception the routes map to a status (api/errors.py): an `EngineError` of the message's kind;
    "internal" (or a kind this side does not know) is the base class, a 500."""
    cls = ERROR_KINDS.get(message.kind)
    if cls is InvalidInputError:
        return InvalidInputError(message.message, message.param)
    if cls is not None:
        return cls(message.message)
    return EngineError(message.message)


# --- plain-data pickles -----------------------------------------------------------------------------------


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if isinstance(found, type) and issubclass(found, BaseException):
            raise pickle.UnpicklingError(f"the channel carries no exception objects ({module}.{name})")
        return found


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return _PlainData(io.BytesIO(data)).load()


# --- the connection -------------------------------------------------------------------------------------------


class Channel:
    """One end of a socket pair. Messages that arrive go to `on_message` on the event loop; when the other
    side is gone, or a message cannot be read, `on_close(reason)` runs once, on the loop, and the channel
    is closed. `send` returns once the message is written (back-pressure: a caller that outpaces the other
    side waits); `post` queues a message without waiting (cancels, state)."""

    def __init__(
        self,
        sock: socket.socket,
        on_message: Callable[[Any], None],
        on_close: Callable[[str], None],
        name: str = "channel",
    ):
        self._sock = sock
        self._conn = Connection(os.dup(sock.fileno()))
        self._on_message = on_message
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-send")  # in order
        self._reader = threading.Thread(target=self._read, name=f"{name}-recv", daemon=True)
        self.closed: str | None = None  # why, once closed
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                message = loads(self._conn.recv_bytes())
                self._loop.call_soon_threadsafe(self._deliver, message)
        except (EOFError, OSError):
            reason = "the other process is gone"
        except Exception as exc:  # a message that cannot be read: the channel cannot be trusted any more
            log.exception("the channel read a message it cannot decode; closing it")
            reason = f"a message could not be decoded: {exc}"
        try:
            self._loop.call_soon_threadsafe(self.close, reason)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _deliver(self, message: Any) -> None:
        if self.closed:
            return
        try:
            self._on_message(message)
        except Exception as exc:  # a bug in the handler: fail what is pending, once, not the listener
            log.exception(
                "unexpected error handling a %s message; closing the channel", type(message).__name__
            )
            self.close(f"unexpected error: {type(exc).__name__}: {exc}")

    async def send(self, message: Any) -> None:
        """Write `message` (pickled here: an unpicklable value raises here, to the caller); OSError when
        the channel is closed."""
        if self.closed:
            raise OSError(self.closed)
        data = dumps(message)
        await asyncio.wrap_future(self._writer.submit(self._conn.send_bytes, data))

    def post(self, message: Any) -> None:
        """Queue `message`; a channel that is closed drops it."""
        if self.closed:
            return
        future = self._writer.submit(self._conn.send_bytes, dumps(message))
        future.add_done_callback(lambda f: f.exception())  # a write to a gone peer: its reader says so

    def close(self, reason: str = "closed") -> None:
        """Stop both threads (the reader sees EOF) and tell `on_close`, once."""
        if self.closed:
            return
        self.closed = reason
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._writer.shutdown(wait=False, cancel_futures=True)
        try:
            self._on_close(reason)
        finally:
            self._reader.join(timeout=1.0)
            self._conn.close()
            self._sock.close()


# --- trace context across the channel ------------------------------------------------------------------------
# OpenTelemetry is imported only while tracing is on (as observability.py does), so these cost one test then.


def trace_context() -> dict[str, str]:
    """The current span's context as W3C headers ({} when not tracing), for a `Call`."""
    if observability.tracer_provider() is None:
        return {}
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def traced_as(carrier: dict[str, str]) -> Iterator[None]:
    """Run a call's block in its caller's trace context, so the engine's spans join the request's tree."""
    if not carrier or observability.tracer_provider() is None:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        context.detach(token)
