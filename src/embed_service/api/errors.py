"""The one place that maps error kinds to HTTP status codes and the OpenAI error body.

Body: {"error": {"message", "type", "param", "code"}}. A stack trace never reaches a client.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from embed_service.engine.errors import (
    DeviceMemoryError,
    EngineError,
    InvalidInputError,
    ModelNotFoundError,
    NotReadyError,
    OverloadedError,
)
from embed_service.requests.validation import invalid_input

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in the metrics, never seen by a client


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or invalid API key: send 'Authorization: Bearer <key>'",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def unsupported_media_type(content_type: str | None) -> APIError:
    got = f"'{content_type}'" if content_type else "none"
    return APIError(
        415,
        f"the body must be JSON, sent with 'Content-Type: application/json' (got {got})",
        "invalid_request_error",
        code="unsupported_media_type",
    )


def request_timeout(seconds: float) -> APIError:
    # The rest of the body may still be on its way: the connection cannot carry another request.
    return APIError(
        408,
        f"the request body was not received within {seconds:g} s",
        "invalid_request_error",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def client_closed() -> APIError:
    return APIError(CLIENT_CLOSED, "client closed the request", "invalid_request_error")


def unavailable(message: str, code: str = "unavailable") -> APIError:
    """Every 503 goes through here, so every 503 carries Retry-After."""
    return APIError(503, message, "service_unavailable", code=code, headers=dict(RETRY_AFTER))


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than the limit of {limit} bytes",
        "invalid_request_error",
        code="request_too_large",
    )


def from_engine(exc: EngineError) -> APIError:
    if isinstance(exc, InvalidInputError):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, OverloadedError):
        return APIError(429, str(exc), "rate_limit_error", code="overloaded", headers=dict(RETRY_AFTER))
    if isinstance(exc, NotReadyError):
        return unavailable(str(exc))
    if isinstance(exc, DeviceMemoryError):  # not a bug: said as it is, and not worth a retry
        return APIError(500, str(exc), "server_error", code="out_of_memory")
    return APIError(500, "internal error", "server_error")


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    err = invalid_input(exc.errors())
    return invalid_request(str(err), err.param)


def error_body(err: APIError) -> bytes:
    return orjson.dumps(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    )


def error_response(err: APIError) -> Response:
    return Response(
        error_body(err), status_code=err.status, media_type="application/json", headers=err.headers
    )


def answered(exc: BaseException) -> APIError | None:
    """The answer to an exception a route may raise, or None for one that is a bug (a 500, logged). The
    app's exception handlers and the hot routes (api/hot_routes.py) both answer through this."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClientDisconnect):
        # Whatever part of a route saw the disconnect: a 499 (its one line is the access line), not a
        # traceback and a 500.
        return client_closed()
    if isinstance(exc, EngineError):
        return from_engine(exc)
    if isinstance(exc, RequestValidationError):
        return from_validation(exc)
    if isinstance(exc, StarletteHTTPException):
        types = {404: "not_found_error", 405: "invalid_request_error"}
        return APIError(
            exc.status_code,
            str(exc.detail),
            types.get(exc.status_code, "invalid_request_error"),
            headers=dict(exc.headers or {}),
        )
    return None


def install_handlers(app: FastAPI) -> None:
    async def _known(_: Request, exc: Exception) -> Response:
        err = answered(exc)
        assert err is not None  # registered below for the kinds answered() knows
        return error_response(err)

    for kind in (APIError, ClientDisconnect, EngineError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal error", "server_error"))
