"""The POST routes answered without FastAPI's routing layers.

Every POST route of the API takes the request and the API-key check, nothing else: it reads and validates
its own body (routes.read_json) and returns a finished Response. For those routes FastAPI's exception and
exit-stack middlewares, the route table's regex matching, the request/response wrapper and the dependency
solver do nothing the route needs, yet every request passes them, and every resumption of its task (after
the body, after the batch) resumes each of their coroutine frames. With one input per request that was a
fifth of the HTTP process's CPU.

`HotRoutes` sits inside the access line (api/access_log.py, which still times, counts and logs every
request and answers an unexpected exception's 500) and calls such a route directly: the same API-key
check, the same route function, exceptions answered as the app's handlers answer them (errors.answered).
Anything else, including the same path with another method or a trailing slash, goes on to FastAPI as
before. The routes stay registered with FastAPI for /openapi.json. With tracing on the requests take
FastAPI's path, whose routing names the route on the HTTP server span.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from embed_service.api.errors import answered, error_response

Endpoint = Callable[[Request, None], Awaitable[Response]]


def hot_endpoints(routes: Iterable[Any], check: Callable[[Request], Awaitable[None]]) -> dict[str, Endpoint]:
    """Path -> route function, for every POST-only route whose one dependency is `check` and whose only
    parameter besides it is the request (no path, query, header or body parameters for FastAPI to solve)."""
    table: dict[str, Endpoint] = {}
    for route in routes:
        if not isinstance(route, APIRoute) or route.methods != {"POST"}:
            continue
        d = route.dependant
        if (
            [dep.call for dep in d.dependencies] == [check]
            and d.request_param_name is not None
            and not (d.path_params or d.query_params or d.header_params or d.cookie_params or d.body_params)
            and "{" not in route.path
        ):
            table[route.path] = route.endpoint
    return table


class HotRoutes:
    """Pure ASGI: POST to a path of `endpoints` runs `check` and the route function here; the rest goes on
    to `app`."""

    def __init__(
        self, app: ASGIApp, endpoints: dict[str, Endpoint], check: Callable[[Request], Awaitable[None]]
    ):
        self.app = app
        self.endpoints = endpoints
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(get_route_path(scope))
            if endpoint is not None:
                request = Request(scope, receive)
                try:
                    await self.check(request)
                    response = await endpoint(request, None)
                except Exception as exc:
                    err = answered(exc)
                    if err is None:
                        raise  # a bug: the access line's layer logs it once and answers 500
                    response = error_response(err)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
