"""The HTTP routes. Thin: parse, ask the engine, shape the answer. No tensors here."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from embed_service import __version__, metrics
from embed_service.api.access_log import note
from embed_service.api.errors import APIError, from_validation, invalid_request, too_large, unauthorized
from embed_service.api.schemas import EmbeddingRequest, TokenizeRequest
from embed_service.engine.engine import EmbedOptions, Engine

router = APIRouter()
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def server(request: Request) -> Any:
    return request.app.state.server


def check_api_key(request: Request) -> None:
    key = server(request).settings.api_key
    if key and request.headers.get("authorization", "") != f"Bearer {key}":
        raise unauthorized()


Authorized = Annotated[None, Depends(check_api_key)]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
    )


def base64_rows(vectors: np.ndarray) -> list[str]:
    """(n, d) float32 -> one base64 string of little-endian float32 bytes per row.

    When a row is a whole number of 3-byte groups (4 * d divisible by 3: 384, 768, 1024 ...) the base64 of
    the whole buffer is the rows' base64 strings laid end to end, so one encode over the buffer and string
    slices replace n encodes.
    """
    raw = np.ascontiguousarray(vectors, dtype="<f4")
    n, d = raw.shape
    if (4 * d) % 3:
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in raw]
    text = base64.b64encode(raw.data).decode("ascii")
    step = 4 * d // 3 * 4
    return [text[i * step : (i + 1) * step] for i in range(n)]


async def read_json(request: Request, schema: type[M]) -> M:
    """The body, parsed and validated; oversize bodies are refused before they are read whole."""
    limit = server(request).settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    try:
        data = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (its sequences then leave the queue)."""
    task = asyncio.ensure_future(work)
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:  # nobody is listening; 499 (client closed request) is what the metrics record
            raise APIError(499, "client closed the request", "invalid_request_error") from None
        raise
    finally:
        watcher.cancel()


def serving(request: Request, name: str | None) -> Engine:
    state = server(request)
    if state.draining:
        raise APIError(503, "the server is shutting down", "service_unavailable", code="unavailable")
    engine = state.models.get(name)
    request.scope.setdefault("state", {})["model"] = engine.name
    return engine


@router.post("/v1/embeddings")
@router.post("/embeddings", include_in_schema=False)
async def embeddings(request: Request, _: Authorized) -> Response:
    body = await read_json(request, EmbeddingRequest)
    note(request, inputs=len(body.input))
    engine = serving(request, body.model)
    # Admission (the client batch limit, the character budgets, capacity) is the engine's, for every route.
    opts = EmbedOptions(
        body.truncate,
        body.truncation_direction,
        body.normalize,
        body.dimensions,
        body.prompt_name,
        body.prompt,
    )
    result = await until_disconnect(request, engine.embed(body.input, opts))
    note(request, tokens=result.prompt_tokens)
    vectors = result.embeddings  # (n, d) float32
    if body.encoding_format == "base64":
        data = [
            {"object": "embedding", "index": i, "embedding": text}
            for i, text in enumerate(base64_rows(vectors))
        ]
    else:
        # orjson writes each float32 row straight from the array: no per-float Python objects.
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": body.model or engine.name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
    )


@router.post("/tokenize")
async def tokenize(request: Request, _: Authorized) -> Response:
    body = await read_json(request, TokenizeRequest)
    note(request, inputs=len(body.input))
    engine = serving(request, body.model)
    opts = EmbedOptions(
        body.truncate, body.truncation_direction, prompt_name=body.prompt_name, prompt=body.prompt
    )
    ids = await until_disconnect(request, engine.tokenize(body.input, opts))
    note(request, tokens=sum(len(t) for t in ids))
    return json_response(
        {
            "data": [{"index": i, "tokens": t, "count": len(t)} for i, t in enumerate(ids)],
            "model": body.model or engine.name,
        }
    )


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def models(request: Request, _: Authorized) -> Response:
    state = server(request)
    return json_response(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "embed-service", "root": e.name}
                for name, e in state.models.by_name.items()
            ],
        }
    )


@router.get("/info")
async def info(request: Request, _: Authorized) -> Response:
    state = server(request)
    body = state.models.default.info()
    body["version"] = __version__
    if len(state.models.engines) > 1:
        body["models"] = [e.info() for e in state.models.engines]
    return json_response(body)


@router.get("/live")
async def live() -> Response:
    return json_response({"status": "alive"})


@router.get("/health")
async def health(request: Request) -> Response:
    state = server(request)
    if state.draining:
        return json_response({"status": "draining"}, 503)
    if state.fatal:
        return json_response({"status": "unhealthy", "reason": state.fatal}, 503)
    # 503 only while a model has no replica that can serve; one restarting beside a serving one is fine.
    restarting = [e for e in state.models.engines if e.state == "restarting"]
    if restarting:
        return json_response({"status": "restarting", "reason": restarting[0].failure}, 503)
    if not state.models.ready:
        return json_response({"status": "loading"}, 503)
    return json_response({"status": "ok"})


@router.get("/metrics")
async def prometheus() -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)
