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
from starlette.responses import Response

from embed_service.engine.errors import (
    EngineError,
    InvalidInputError,
    ModelNotFoundError,
    NotReadyError,
    OverloadedError,
)

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


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
    )


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
        return APIError(
            429,
            str(exc),
            "rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, NotReadyError):
        return APIError(
            503,
            str(exc),
            "service_unavailable",
            code="unavailable",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    return APIError(500, "internal error", "server_error")


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    where = ".".join(loc)
    return invalid_request(f"{where}: {msg}" if where else msg, param)


def error_response(err: APIError) -> Response:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return Response(
        orjson.dumps(body), status_code=err.status, media_type="application/json", headers=err.headers
    )


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> Response:
        return error_response(from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        types = {404: "not_found_error", 405: "invalid_request_error"}
        err = APIError(
            exc.status_code,
            str(exc.detail),
            types.get(exc.status_code, "invalid_request_error"),
            headers=dict(exc.headers or {}),
        )
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal error", "server_error"))
