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
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator
from starlette.responses import Response

from embed_service.api.access_log import note
from embed_service.api.openapi import errors, json_body, ok
from embed_service.api.routes import Authorized, json_response, read_json, serving, until_disconnect
from embed_service.api.schemas import TEXT_INPUT, Cut, Priority, _check_input
from embed_service.engine.text import EmbedOptions

router = APIRouter()


class RerankDocument(BaseModel):
    """A document as an object (Cohere v1, Jina): its text."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank: Cohere's and Jina's rerank request."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    query: StrictStr = Field(min_length=1)
    """The query every document is scored against."""
    documents: list[StrictStr | RerankDocument] = Field(min_length=1)
    """The documents: strings, or objects with a ``text``. At most --max-client-batch-size."""
    top_n: Cut | None = None
    """Return the best N results only; default, or N at least the number of documents: all of them."""
    return_documents: StrictBool = False
    """Return each result's document text beside its index."""
    truncate: StrictBool = True
    """Cut a pair longer than the max input length (longest_first, as CrossEncoder); false: a 400."""
    max_tokens_per_doc: Cut | None = None
    """Cut each document to this many tokens first (Cohere v2); the pair's limit still applies."""
    rank_fields: Any = None
    """Accepted and ignored (Cohere v1): documents are scored by their text."""
    max_chunks_per_doc: Any = None
    """Accepted and ignored (Cohere v1)."""
    priority: Priority | None = None
    """Accepted and ignored."""
    instruction: StrictStr | None = None
    """An LLM reranker's task instruction (default: --rerank-instruction); a cross-encoder refuses it."""

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        # Said here: pydantic's own message names a union branch ("documents.0.str: ...") and not the
        # object form a client meant to send.
        if not isinstance(v, list):
            raise ValueError("must be a list of strings, or of objects with a text (Cohere v1, Jina)")
        for i, d in enumerate(v):
            if not (isinstance(d, str) or (isinstance(d, dict) and isinstance(d.get("text"), str))):
                got = f"an object with keys {sorted(d)[:5]}" if isinstance(d, dict) else type(d).__name__
                raise ValueError(
                    f'document {i} must be a string or an object with a string text ({{"text": ...}}), '
                    f"got {got}"
                )
        return v


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


class ClassifyRequest(BaseModel):
    """POST /classify: texts to classify with a sequence-classification model."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    input: Annotated[list[str], TEXT_INPUT]
    """A text or a list of texts (at most --max-client-batch-size)."""
    truncate: StrictBool | None = None
    """Cut texts longer than the max input length; default: --auto-truncate."""

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        out = _check_input(v)
        if not isinstance(out[0], str):
            raise ValueError("must be a text or a list of texts")
        return out


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
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
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
    result = await until_disconnect(request, engine.classify(body.input, EmbedOptions(body.truncate)))
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
