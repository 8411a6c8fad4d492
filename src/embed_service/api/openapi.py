"""/openapi.json: the routes' declarations (request body, success body, every error each can give), the
request models FastAPI cannot see (bodies are parsed by hand), and the bearer scheme when a key is set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from embed_service.api.schemas import CohereEmbedRequest, ErrorResponse
from embed_service.requests.embed import EmbeddingRequest, SparseEmbedRequest, TokenizeRequest

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    EmbeddingRequest,
    SparseEmbedRequest,
    TokenizeRequest,
    CohereEmbedRequest,
)

_WHEN = {
    400: "Invalid request: malformed JSON, a field of the wrong type or value, an input the model cannot "
    "take (a token id outside the vocabulary, too long with truncation off), too many inputs",
    401: "Missing or wrong API key",
    404: "The model asked for is not served",
    408: "The body did not arrive within --body-timeout; the connection is closed",
    413: "The body is larger than --max-request-bytes",
    415: "The body was not sent as application/json",
    429: "Admitting the inputs would pass --max-concurrent-requests; retry after Retry-After seconds",
    500: "An input too large for the device's memory even alone (code out_of_memory), else an internal error (a bug)",
    503: "Loading, draining after SIGTERM, or no replica can serve; retry after Retry-After seconds",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying",
        "required": True,
        "schema": {"type": "integer"},
    }
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    429: _RETRY_AFTER,
    503: _RETRY_AFTER,
}


def json_body(model: type[BaseModel], example: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` from its JSON body (`example`: what /docs fills in)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    media = {"schema": ref, "example": example}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "Success"}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: _error(s) for s in statuses}


def unready(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        503: {
            "model": model,
            "description": "Loading, draining, restarting or unhealthy",
            "headers": _RETRY_AFTER,
        }
    }


def _error(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": ErrorResponse, "description": _WHEN[status]}
    if status in _HEADERS:
        out["headers"] = _HEADERS[status]
    return out


def _uses(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return any(d.call is call or _uses(d, call) for d in dependant.dependencies)


def install(
    app: FastAPI,
    routers: list[APIRouter],
    auth: Callable[..., Any],
    keys_set: bool,
    request_models: tuple[type[BaseModel], ...] = (),
) -> None:
    """Make `app.openapi()` describe the whole API; `auth` is the dependency of `routers`' routes that
    checks the key; `request_models`: the bodies of the other routes (api/rerank.py's)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for model in REQUEST_MODELS + request_models:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        if keys_set:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for route in (r for router in routers for r in router.routes):
                if not (
                    isinstance(route, APIRoute) and route.include_in_schema and _uses(route.dependant, auth)
                ):
                    continue
                for method in route.methods or ():
                    op = schema["paths"][route.path_format][method.lower()]
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = {
                        **{k: v for k, v in _error(401).items() if k != "model"},
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                        },
                    }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
