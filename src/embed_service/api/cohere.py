"""Cohere's embed API: POST /v2/embed (ClientV2.embed) and /v1/embed (Client.embed), for clients written
against Cohere. The same engine admission, auth and encodings as /v1/embeddings; errors in the OpenAI
shape, which the cohere client raises as its status's exception (BadRequestError, NotFoundError, ...).

What maps to what (docs/api.md, "Cohere-compatible embed"):
- ``input_type`` selects the model's sentence-transformers prompt of that purpose, the first of
  PROMPT_NAMES the model has; a model without one embeds as /v1/embeddings does without a prompt field
  (its default prompt, if it names one).
- ``truncate``: END (Cohere's default) cuts the end, START the start, NONE refuses a long input.
- ``embedding_types``: float, base64 (float32 bytes) and the quantized types of requests/encodings.py.
- ``chunking`` and ``late_chunking``: as on /v1/embeddings; each text's chunks come back in ``chunks``,
  each with its vector per embedding type (late_chunking: one vector per text, in ``embeddings``).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from embed_service.api.access_log import note
from embed_service.api.errors import invalid_request
from embed_service.api.openapi import errors, json_body, ok
from embed_service.api.routes import Authorized, json_answer, read_json, serving, until_disconnect
from embed_service.api.schemas import CohereEmbedRequest, CohereEmbedResponse
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.protocol import ServingEngine
from embed_service.engine.text import EmbedOptions, output_dimension
from embed_service.images.inputs import ImageInput
from embed_service.outputs import DENSE_ONLY
from embed_service.requests import encodings
from embed_service.requests.embed import chunk_options

router = APIRouter()

# input_type -> the prompt names that serve it, in order of preference (nomic-style names first, then the
# query/document names of e5, bge, gte and arctic configs).
PROMPT_NAMES = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
TRUNCATION = {"END": (True, "right"), "START": (True, "left"), "NONE": (False, "right")}
_ROUTE: dict[str, Any] = {
    "openapi_extra": json_body(
        CohereEmbedRequest,
        {"model": "all-MiniLM-L6-v2", "texts": ["hello world"], "input_type": "search_query"},
    ),
    "responses": {**ok(CohereEmbedResponse), **errors(400, 404, 408, 413, 415, 429, 500, 503)},
}


def items_of(body: CohereEmbedRequest) -> list[Any]:
    """The texts (str) and images (ImageInput) to embed, from texts, images or inputs (one of them)."""
    given = [f for f in ("texts", "images", "inputs") if getattr(body, f)]
    if len(given) != 1:
        raise invalid_request(
            "send one of texts, images or inputs", "images" if body.images and given else "texts"
        )
    if body.images:
        if body.input_type != "image":
            raise invalid_request('images are embedded with input_type "image"', "input_type")
        return [ImageInput(url) for url in body.images]
    if body.input_type == "image" and body.texts:
        raise invalid_request('input_type "image" goes with images', "input_type")
    if body.texts is not None:
        return body.texts
    items: list[Any] = []
    for i, item in enumerate(body.inputs or ()):
        images = [part for part in item.content if part.type == "image_url"]
        if images:
            if len(item.content) != 1:
                raise invalid_request(
                    f"inputs[{i}]: one image per input, without text (this model embeds texts and images "
                    "apart: send them as separate inputs)",
                    "inputs",
                )
            url = images[0].image_url
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise invalid_request(f'inputs[{i}]: an image_url part needs {{"url": "data:..."}}', "inputs")
            items.append(ImageInput(url))
            continue
        text = "\n".join(part.text or "" for part in item.content)
        if not text:
            raise invalid_request(f"inputs[{i}] has no text", "inputs")
        items.append(text)
    return items


def options(body: CohereEmbedRequest, engine: ServingEngine) -> EmbedOptions:
    limit = engine.spec.max_input_length
    if body.max_tokens is not None and body.max_tokens < limit:
        raise invalid_request(
            f"max_tokens below the model's max input length ({limit}) is not supported", "max_tokens"
        )
    output_dimension(body.output_dimension, engine.spec.dimension, "output_dimension")
    names = PROMPT_NAMES.get(body.input_type or "", ())
    prompt_name = next((n for n in names if n in engine.spec.prompts), None)
    truncate, direction = TRUNCATION[body.truncate or "END"]
    # Cohere embeds are dense vectors, whatever the model gives by default (a SPLADE model refuses them).
    return EmbedOptions(
        truncate,
        direction,
        dimensions=body.output_dimension,
        prompt_name=prompt_name,
        outputs=DENSE_ONLY.kinds,
        chunking=chunk_options(body.chunking, body.late_chunking),
    )


async def embed(request: Request, by_type: bool) -> Response:
    body = await read_json(request, CohereEmbedRequest)
    items = items_of(body)
    texts = [x for x in items if isinstance(x, str)]
    note(request, inputs=len(items))
    engine = serving(request, body.model)
    opts = options(body, engine)
    types = list(dict.fromkeys(body.embedding_types or ["float"]))
    dimension = opts.dimensions or engine.spec.dimension
    integer = [t for t in types if t in encodings.INTEGER_DTYPES]
    if body.embed_ranges is not None and not integer:
        raise invalid_request("embed_ranges applies to embedding_types int8 and uint8", "embed_ranges")
    ranges = encodings.check_ranges("int8", body.embed_ranges, dimension) if integer else None
    try:
        result = await until_disconnect(request, engine.embed(items, opts))
    except InvalidInputError as exc:
        if exc.param != "input":
            raise
        # The engine's input is this route's texts or inputs: name the field the client sent.
        field = "texts" if body.texts is not None else "images" if body.images else "inputs"
        raise InvalidInputError(str(exc), field) from None
    note(request, tokens=result.prompt_tokens)
    vectors = result.embeddings  # (n, d) float32, sliced and normalized

    def encoded(matrix: np.ndarray) -> dict[str, Any]:
        return {
            t: encodings.rows(matrix, "float32", "base64", None)
            if t == "base64"
            else encodings.rows(matrix, "float32" if t == "float" else t, "float", ranges)
            for t in types
        }

    def answer() -> dict[str, Any]:
        embeddings: Any = encoded(vectors) if by_type or body.embedding_types else vectors
        tokens = {"input_tokens": result.prompt_tokens}
        extra: dict[str, Any] = {}
        if result.chunks is not None:  # late chunking (or windows with return_chunks): each text's chunks
            extra["chunks"] = []
            for chunks in result.chunks:
                rows = encoded(chunks.vectors)
                extra["chunks"].append(
                    [
                        {"start": a, "end": b, "tokens": n, "embeddings": {t: rows[t][j] for t in types}}
                        for j, (a, b, n) in enumerate(chunks.spans)
                    ]
                )
        return {
            "response_type": "embeddings_by_type" if isinstance(embeddings, dict) else "embeddings_floats",
            "id": str(uuid.uuid4()),
            "embeddings": embeddings,
            "texts": texts,
            "meta": {
                "api_version": {"version": "2" if by_type else "1"},
                "billed_units": tokens,
                "tokens": tokens,
            },
            **extra,
        }

    chunked = sum(c.vectors.size for c in result.chunks or ())
    return await json_answer(answer, (vectors.size + chunked) * len(types))


@router.post("/v2/embed", summary="Embed texts (Cohere embed API v2)", **_ROUTE)
async def embed_v2(request: Request, _: Authorized) -> Response:
    return await embed(request, by_type=True)


@router.post("/v1/embed", summary="Embed texts (Cohere embed API v1)", **_ROUTE)
async def embed_v1(request: Request, _: Authorized) -> Response:
    return await embed(request, by_type=False)
