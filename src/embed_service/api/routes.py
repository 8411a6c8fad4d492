"""The HTTP routes. Thin: parse, ask the engine, shape the answer. No tensors here.

Bodies are read and parsed by hand (`read_json`: orjson, the size limit while reading, 400 never 422); the
decorators only declare them, and every error a route can give, for /openapi.json.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse, Response

from embed_service import __version__, metrics
from embed_service.api.access_log import note
from embed_service.api.errors import (
    RETRY_AFTER,
    client_closed,
    from_validation,
    invalid_request,
    request_timeout,
    too_large,
    unauthorized,
    unavailable,
    unsupported_media_type,
)
from embed_service.api.http_limits import disconnect_hooks
from embed_service.api.openapi import errors, json_body, ok, unready
from embed_service.api.schemas import (
    EmbedAllResponse,
    EmbeddingResponse,
    Health,
    Info,
    Live,
    ModelList,
    SparseEmbedResponse,
    TokenizeResponse,
)
from embed_service.engine.chunking import Chunks
from embed_service.engine.protocol import ServingEngine
from embed_service.engine.text import EmbedResult
from embed_service.requests import encodings
from embed_service.requests.embed import (
    EmbedAllRequest,
    EmbeddingRequest,
    SparseEmbedRequest,
    TokenizeRequest,
    embed_call,
    sparse_options,
    tokenize_options,
    tokens_options,
)

router = APIRouter()
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def server(request: Request) -> Any:
    return request.app.state.server


async def check_api_key(request: Request) -> None:
    # A coroutine, though it never awaits: FastAPI runs a plain `def` dependency on its thread pool, a
    # hop to a thread and back on every request (~60 us of the HTTP process's CPU per request).
    keys = server(request).api_keys
    if keys and not keys.accepts(request.headers.get("authorization")):
        raise unauthorized()


Authorized = Annotated[None, Depends(check_api_key)]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# An answer of more values than this is encoded and serialized on a thread: the largest answers (at most
# --max-client-batch-size x the dimension values, or a ColBERT request's tokens x its width; docs/api.md,
# Admission) then never hold the event loop that every other request's reads and answers wait on.
OFF_LOOP_VALUES = 1 << 16


def result_values(result: EmbedResult) -> int:
    """How many numbers an embed result's answer carries (what its encoding and serialization cost)."""
    values = result.embeddings.size
    values += sum(c.vectors.size for c in result.chunks or ())
    values += sum(2 * s.values.size for s in result.sparse or ())
    values += sum(m.size for m in result.tokens or ())
    return values + sum(m.size for m in result.colbert or ())


async def json_answer(build: Callable[[], Any], values: int) -> Response:
    """`build()`'s body as a JSON response: built inline when small, on a thread past OFF_LOOP_VALUES."""
    if values <= OFF_LOOP_VALUES:
        return json_response(build())
    body = await asyncio.to_thread(lambda: orjson.dumps(build(), option=orjson.OPT_SERIALIZE_NUMPY))
    return Response(body, media_type="application/json")


def chunk_items(chunks: Chunks, rows: Any) -> list[dict[str, Any]]:
    """The windows of one chunked input, each with its vector encoded as the input's."""
    return [
        {"start": start, "end": end, "tokens": tokens, "embedding": row}
        for (start, end, tokens), row in zip(chunks.spans, rows)
    ]


def is_json(content_type: str | None) -> bool:
    """``application/json``, parameters (``; charset=utf-8``) allowed. Anything else is refused, which also
    keeps a page on another site from posting here with a form or a CORS-free ``text/plain`` request."""
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"


async def read_body(request: Request, limit: int) -> bytes:
    received, size = [], 0
    async for data in request.stream():
        size += len(data)
        if size > limit:
            raise too_large(limit)
        received.append(data)
    return b"".join(received)


async def read_json(request: Request, schema: type[M]) -> M:
    """The body, parsed and validated; oversize bodies are refused before they are read whole, and a body
    that does not arrive within --body-timeout gets 408."""
    settings = server(request).settings
    content_type = request.headers.get("content-type")
    if not is_json(content_type):
        raise unsupported_media_type(content_type)
    limit = settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    try:
        raw = await asyncio.wait_for(read_body(request, limit), settings.body_timeout)
    except asyncio.TimeoutError:
        raise request_timeout(settings.body_timeout) from None
    except ClientDisconnect:
        raise client_closed() from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (its sequences then leave the queue).

    Served by our HTTP protocol (http_limits), the request's own task runs `work` and the protocol cancels
    it when the connection is lost; elsewhere (another ASGI server) a second task watches `receive()`."""
    hooks = disconnect_hooks(request.scope)
    if hooks is None:
        return await _watching(request, work)
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    hooks.append(on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:  # nobody is listening; 499 (client closed request) is what the metrics record
            if sys.version_info >= (3, 11):
                task.uncancel()  # the cancellation is answered here, not by the caller
            raise client_closed() from None
        raise
    finally:
        hooks.remove(on_gone)


async def _watching(request: Request, work: Awaitable[T]) -> T:
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
        if gone:
            raise client_closed() from None
        raise
    finally:
        watcher.cancel()


def serving(request: Request, name: str | None) -> ServingEngine:
    state = server(request)
    if state.draining:
        raise unavailable("the server is shutting down")
    engine = state.models.get(name)
    request.scope.setdefault("state", {})["model"] = engine.name
    return engine


@router.post(
    "/v1/embeddings",
    summary="Embed texts or token ids (OpenAI embeddings API)",
    openapi_extra=json_body(EmbeddingRequest, {"input": ["hello world", "a second text"]}),
    responses={**ok(EmbeddingResponse), **errors(400, 404, 408, 413, 415, 429, 500, 503)},
)
@router.post("/embeddings", include_in_schema=False)
async def embeddings(request: Request, _: Authorized) -> Response:
    body = await read_json(request, EmbeddingRequest)
    note(request, inputs=len(body.input))
    engine = serving(request, body.model)
    # Admission (the client batch limit, the character budgets, capacity) is the engine's, for every route.
    # Checked before anything is sized by it: the encodings' ranges, then the response.
    call = embed_call(body, engine)
    ranges = call.ranges
    result = await until_disconnect(request, engine.embed(body.input, call.opts))
    note(request, tokens=result.prompt_tokens)
    dense = "dense" in call.kinds

    def answer() -> dict[str, Any]:
        b64 = body.encoding_format == "base64"
        data: list[dict[str, Any]] = [{"object": "embedding", "index": i} for i in range(len(body.input))]
        if dense:
            # base64 strings, or arrays orjson writes straight as numbers: no per-value Python objects.
            rows = encodings.rows(result.embeddings, body.embed_dtype, body.encoding_format, ranges)
            for item, row in zip(data, rows):
                item["embedding"] = row
        if result.chunks is not None:
            for item, chunks in zip(data, result.chunks):
                windows = encodings.rows(chunks.vectors, body.embed_dtype, body.encoding_format, ranges)
                item["chunks"] = chunk_items(chunks, windows)
        for item, sparse in zip(data, result.sparse or ()):
            item["sparse"] = {"indices": sparse.indices, "values": sparse.values}
            if body.sparse_tokens:
                item["sparse"]["tokens"] = engine.tokenizer.tokens(sparse.indices.tolist())
        for item, matrix in zip(data, result.colbert or ()):  # float32 whatever the embed_dtype
            item["colbert"] = encodings.base64_rows(matrix) if b64 else matrix
        for item, matrix in zip(data, result.tokens or ()):  # float32, every token's last hidden state
            item["tokens"] = encodings.base64_rows(matrix) if b64 else matrix
        return {
            "object": "list",
            "data": data,
            "model": body.model or engine.name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }

    return await json_answer(answer, result_values(result))


@router.post(
    "/embed_sparse",
    summary="Lexical (sparse) weights, as text-embeddings-inference's /embed_sparse",
    openapi_extra=json_body(SparseEmbedRequest, {"inputs": ["hello world"]}),
    responses={**ok(SparseEmbedResponse), **errors(400, 404, 408, 413, 415, 429, 500, 503)},
)
async def embed_sparse(request: Request, _: Authorized) -> Response:
    body = await read_json(request, SparseEmbedRequest)
    note(request, inputs=len(body.inputs))
    engine = serving(request, body.model)
    result = await until_disconnect(request, engine.embed(body.inputs, sparse_options(body)))
    note(request, tokens=result.prompt_tokens)
    # The weights stay numpy float32 scalars: orjson writes each as the shortest text that reads back as
    # the same float32, as /v1/embeddings writes them (a Python float would be the double's 17 digits).
    return await json_answer(
        lambda: [
            [{"index": int(i), "value": v} for i, v in zip(s.indices.tolist(), s.values)]
            for s in result.sparse or ()
        ],
        result_values(result),
    )


@router.post(
    "/embed_all",
    summary="Every token's vector, as text-embeddings-inference's /embed_all",
    openapi_extra=json_body(EmbedAllRequest, {"inputs": ["hello world"]}),
    responses={**ok(EmbedAllResponse), **errors(400, 404, 408, 413, 415, 429, 500, 503)},
)
async def embed_all(request: Request, _: Authorized) -> Response:
    body = await read_json(request, EmbedAllRequest)
    note(request, inputs=len(body.inputs))
    engine = serving(request, body.model)
    result = await until_disconnect(request, engine.embed(body.inputs, tokens_options(body)))
    note(request, tokens=result.prompt_tokens)
    return await json_answer(lambda: list(result.tokens or ()), result_values(result))


@router.post(
    "/tokenize",
    summary="The token ids /v1/embeddings would embed",
    openapi_extra=json_body(TokenizeRequest, {"input": "hello world"}),
    responses={**ok(TokenizeResponse), **errors(400, 404, 408, 413, 415, 429, 500, 503)},
)
async def tokenize(request: Request, _: Authorized) -> Response:
    body = await read_json(request, TokenizeRequest)
    note(request, inputs=len(body.input))
    engine = serving(request, body.model)
    ids = await until_disconnect(request, engine.tokenize(body.input, tokenize_options(body)))
    note(request, tokens=sum(len(t) for t in ids))
    return json_response(
        {
            "data": [{"index": i, "tokens": t, "count": len(t)} for i, t in enumerate(ids)],
            "model": body.model or engine.name,
        }
    )


@router.get("/v1/models", summary="The served model names", responses=ok(ModelList))
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


@router.get(
    "/info",
    summary="What the server detected and resolved, for one model or every model",
    responses={**ok(Info), **errors(404)},
)
async def info(request: Request, _: Authorized, model: str | None = None) -> Response:
    """The first model's details at the top level (or, with ``?model=``, that model's), every model's under
    ``models``, and the resource plan (``plan``)."""
    state = server(request)
    engine = state.models.get(model)  # an unknown name: 404 model_not_found
    body = engine.info()
    body["version"] = __version__
    body["default_model"] = state.models.default.name
    body["models"] = [e.info() for e in state.models.engines]
    body["plan"] = state.plan.info()
    return json_response(body)


@router.get("/live", summary="Liveness: 200 while the process answers", responses=ok(Live))
async def live() -> Response:
    return json_response({"status": "alive"})


@router.get(
    "/health",
    summary="Readiness: 200 only while every model serves",
    responses={**ok(Health), **unready(Health)},
)
async def health(request: Request) -> Response:
    state = server(request)
    if state.draining:
        return json_response({"status": "draining"}, 503, RETRY_AFTER)
    if state.fatal:
        return json_response({"status": "unhealthy", "reason": state.fatal}, 503, RETRY_AFTER)
    # 503 only while a model has no replica that can serve; one restarting beside a serving one is fine.
    # Every model must serve: a client routed to one that cannot would get 503s from a ready server.
    engines = state.models.engines
    several = {"models": {e.name: e.state for e in engines}} if len(engines) > 1 else {}
    restarting = [e for e in engines if e.state == "restarting"]
    if restarting:
        first = restarting[0]
        reason = f"model {first.name}: {first.failure}" if several else first.failure
        return json_response({"status": "restarting", "reason": reason, **several}, 503, RETRY_AFTER)
    if not state.models.ready:
        return json_response({"status": "loading", **several}, 503, RETRY_AFTER)
    return json_response({"status": "ok", **several})


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
)
async def prometheus(request: Request) -> Response:
    remote = server(request).metrics_text
    text = await remote() if remote else generate_latest(metrics.REGISTRY)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
