"""Scoring routes: POST /rerank, /v1/rerank, /v2/rerank (Cohere's and Jina's rerank API) and /classify.

Served by cross-encoders and sequence classifiers (docs/models.md); an embedding model answers them 400,
as a scoring model answers /v1/embeddings. The same engine admission, auth and error shape as the embed
routes; a rerank request's documents count as its inputs.

Rerank: ``query`` and ``documents`` (strings, or objects with a ``text``) -> ``results`` sorted by
``relevance_score``, best first, the first ``top_n`` of them, each with its document's ``index`` (and the
document, with ``return_documents``). Scores are CrossEncoder.predict's: the logit through the model's
activation (sigmoid by default). Cohere's ``meta`` and Jina's ``usage`` both come back, so either client
reads the answer. Classify: ``input`` (a text or a list) -> per input the most probable label and every
label's probability, as the transformers text-classification pipeline computes them.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from embed_service.api.access_log import note
from embed_service.api.openapi import errors, json_body, ok
from embed_service.api.routes import Authorized, json_response, read_json, serving, until_disconnect
from embed_service.requests.score import ClassifyRequest, RerankDocument, RerankRequest, classify_options

router = APIRouter()


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    meta: dict[str, Any]
    usage: dict[str, int]


class Classification(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    object: str
    model: str
    data: list[Classification]
    usage: dict[str, int]


REQUEST_MODELS = (RerankRequest, ClassifyRequest)
_ERRORS = errors(400, 404, 408, 413, 415, 429, 500, 503)
_RERANK: dict[str, Any] = {
    "openapi_extra": json_body(
        RerankRequest, {"query": "what is a panda?", "documents": ["The giant panda is a bear.", "hi"]}
    ),
    "responses": {**ok(RerankResponse), **_ERRORS},
}


async def rerank(request: Request, version: str) -> Response:
    body = await read_json(request, RerankRequest)
    texts = body.texts
    note(request, inputs=len(texts))
    engine = serving(request, body.model)
    result = await until_disconnect(
        request, engine.rerank(body.query, texts, body.truncate, body.max_tokens_per_doc, body.instruction)
    )
    note(request, tokens=result.tokens)
    scores = result.scores[:, 0]
    order = np.argsort(-scores, kind="stable")[: body.top_n]  # best first; ties keep document order
    results: list[dict[str, Any]] = []
    for i in order.tolist():
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return json_response(
        {
            "id": str(uuid.uuid4()),
            "model": body.model or engine.name,
            "results": results,
            "meta": {
                "api_version": {"version": version},
                "billed_units": {"search_units": 1},
                "tokens": {"input_tokens": result.tokens},
            },
            "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
        }
    )


@router.post("/v2/rerank", summary="Rerank documents for a query (Cohere rerank API v2)", **_RERANK)
async def rerank_v2(request: Request, _: Authorized) -> Response:
    return await rerank(request, "2")


@router.post("/v1/rerank", summary="Rerank documents for a query (Cohere v1, Jina)", **_RERANK)
@router.post("/rerank", summary="Rerank documents for a query", **_RERANK)
async def rerank_v1(request: Request, _: Authorized) -> Response:
    return await rerank(request, "1")


@router.post(
    "/classify",
    summary="Classify texts with a sequence-classification model",
    openapi_extra=json_body(ClassifyRequest, {"input": ["I loved it", "I did not"]}),
    responses={**ok(ClassifyResponse), **_ERRORS},
)
async def classify(request: Request, _: Authorized) -> Response:
    body = await read_json(request, ClassifyRequest)
    note(request, inputs=len(body.input))
    engine = serving(request, body.model)
    result = await until_disconnect(request, engine.classify(body.input, classify_options(body)))
    note(request, tokens=result.tokens)
    labels = engine.spec.score.labels if engine.spec.score else ()
    data = [
        {
            "index": i,
            "label": labels[int(np.argmax(row))],
            "probs": row,
            "num_classes": len(labels),
        }
        for i, row in enumerate(result.scores)
    ]
    return json_response(
        {
            "object": "list",
            "model": body.model or engine.name,
            "data": data,
            "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
        }
    )
