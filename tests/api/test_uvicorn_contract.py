"""The private parts of uvicorn's httptools protocol that api/http_limits.py builds on are still there.

`LimitedHttpToolsProtocol` subclasses `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` and reads
or sets its private state (the request cycle, the pipeline, the keep-alive timer, the parser, ...). A
uvicorn release that renames one would break the limits silently (an AttributeError inside a parser
callback closes the connection), so pyproject.toml bounds uvicorn to the releases this test has passed on,
and this test names what moved.
"""

from __future__ import annotations

import asyncio
import inspect

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from embed_service.api import http_limits

# Instance state that __init__ sets and http_limits reads or assigns.
STATE = [
    "app",
    "client",
    "connections",
    "cycle",
    "headers",
    "limit_concurrency",
    "loop",
    "parser",
    "pipeline",
    "server_state",
    "timeout_keep_alive",
    "timeout_keep_alive_task",
    "transport",
]
# Methods it calls or overrides, by name.
METHODS = [
    "_unset_keepalive_if_required",
    "_unsupported_upgrade_warning",
    "connection_lost",
    "connection_made",
    "data_received",
    "on_headers_complete",
    "on_message_complete",
    "timeout_keep_alive_handler",
]


def protocol() -> httptools_impl.HttpToolsProtocol:
    async def app(scope, receive, send):  # pragma: no cover (never called)
        pass

    config = uvicorn.Config(app, http="httptools", log_config=None)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        return httptools_impl.HttpToolsProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=loop
        )
    finally:
        loop.close()


def test_the_protocol_state_http_limits_uses_is_set_by_uvicorn():
    p = protocol()
    missing = [name for name in STATE if not hasattr(p, name)]
    assert not missing, f"uvicorn {uvicorn.__version__} no longer sets {missing} on HttpToolsProtocol"


def test_the_methods_http_limits_calls_or_overrides_exist():
    cls = httptools_impl.HttpToolsProtocol
    missing = [name for name in METHODS if not callable(getattr(cls, name, None))]
    assert not missing, f"uvicorn {uvicorn.__version__} has no {missing} on HttpToolsProtocol"
    assert set(httptools_impl.STATUS_LINE) >= {400, 408, 431, 503}


def test_each_request_sets_the_url_that_the_head_size_counts():
    # on_headers_complete sizes the head as len(self.url) + the headers: uvicorn sets url per request.
    source = inspect.getsource(httptools_impl.HttpToolsProtocol.on_message_begin)
    assert 'self.url = b""' in source
    assert "self.url += url" in inspect.getsource(httptools_impl.HttpToolsProtocol.on_url)


def test_on_headers_complete_reads_the_app_when_called():
    # The over-limit path swaps `self.app` around the parent's on_headers_complete so that the request
    # runs the 503 app: that works only while the parent reads self.app inside it.
    source = inspect.getsource(httptools_impl.HttpToolsProtocol.on_headers_complete)
    assert "self.app" in source


def test_the_keep_alive_timer_is_armed_as_http_limits_re_arms_it():
    # on_message_complete re-arms the timer with loop.call_later(timeout_keep_alive, handler), as the
    # parent does when a response completes.
    source = inspect.getsource(httptools_impl.HttpToolsProtocol)
    assert "self.timeout_keep_alive_task = self.loop.call_later(" in source
    assert "self.timeout_keep_alive_handler" in source


def test_the_subclass_overrides_only_what_the_parent_defines():
    parent = httptools_impl.HttpToolsProtocol
    own = {n for n, v in vars(http_limits.LimitedHttpToolsProtocol).items() if inspect.isfunction(v)}
    overrides = {n for n in own if not n.startswith("_") or n.startswith("__")} - {"__init__"}
    assert all(hasattr(parent, n) for n in overrides), sorted(n for n in overrides if not hasattr(parent, n))
