"""The embed, sparse-embed and tokenize requests, as the HTTP routes and the Python API validate them, and
what the engine is asked from them: `embed_options`, `sparse_options`, `tokenize_options`, and
`embed_call`, which also checks the encoding fields against the model before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from embed_service.engine.chunking import ChunkOptions
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.protocol import ServingEngine
from embed_service.engine.text import EmbedOptions, output_dimension
from embed_service.images.inputs import ImageInput
from embed_service.requests import encodings
from embed_service.requests.encodings import EmbedDtype
from embed_service.requests.fields import (
    EMBED_INPUT,
    MAX_TOKENS,
    TEXT_INPUT,
    Dimensions,
    EmbedRanges,
    Overlap,
    Span,
    Threshold,
    TokenCount,
    check_input,
    check_texts,
)


class Chunking(BaseModel):
    """How a text is chunked: ``"mode": "window"`` (the default) embeds a text longer than the max input
    length as windows whose vectors are averaged; ``"mode": "late"`` answers one vector per chunk of the
    input from one forward pass of the whole input (late chunking; docs/api.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: StrictBool = True
    """Chunk long texts (sending the object turns it on); false: truncate as without it."""
    overlap: Overlap | None = None
    """Tokens each window (or each size-cut late chunk) shares with the one before it (windows: at most half
    a window; default --chunk-overlap. Late chunks: less than ``size``; default 0)."""
    return_chunks: StrictBool = False
    """Also return each window's vector and its character span in the text (late chunks always come back)."""
    mode: Literal["window", "late"] = "window"
    """``late``: late chunking, with ``spans`` or ``size``."""
    spans: list[Span] | None = Field(None, max_length=MAX_TOKENS)
    """Late chunking: the chunks, as character spans [start, end) of the one input, in the answer's order."""
    size: TokenCount | None = None
    """Late chunking: chunks of this many text tokens, cut by the server."""
    context_overlap: Overlap | None = None
    """Long late chunking (an input past the max input length, as macro-windows): the tokens of context each
    window shares with the one before (at most half a window; default 0)."""


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings, per the OpenAI spec, plus the documented extensions."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    input: Annotated[list[str] | list[list[int]] | list[str | ImageInput], EMBED_INPUT]
    model: str | None = None
    """A served model name; default: the first served model."""
    encoding_format: Literal["float", "base64"] | None = None
    """``base64``: each vector as base64 of its little-endian bytes (float32 unless embed_dtype says).
    Default: float (JSON numbers)."""
    dimensions: Dimensions | None = None
    """Keep the first N features (at most the model's dimension), then re-normalize."""
    user: str | None = None
    """Accepted and ignored."""
    # Extensions
    truncate: StrictBool | None = None
    """Cut inputs past the max input length (default: the server's --auto-truncate); false: 400."""
    truncation_direction: Literal["right", "left"] = "right"
    """Which end of the content is cut; special tokens are kept."""
    normalize: StrictBool | None = None
    """L2-normalize the vectors. Default: the model's."""
    prompt_name: StrictStr | None = None
    """One of the model's named prompts (config_sentence_transformers.json), prepended to text inputs."""
    prompt: StrictStr | None = None
    """A raw prefix for text inputs, instead of a named prompt."""
    embed_dtype: EmbedDtype = "float32"
    """The type of each value (after dimensions and normalization): see docs/api.md, Compact encodings."""
    embed_ranges: EmbedRanges | None = None
    """int8/uint8 only: [low, high] for every dimension, or [[lows...], [highs...]]. Default [-1, 1]."""
    chunking: Chunking | None = None
    """Embed texts past the max input length as averaged windows (default: the server's --chunk-long-inputs)."""
    late_chunking: StrictBool = False
    """Jina's late chunking: the inputs are the consecutive chunks of one document, embedded in one forward
    pass (joined as they are); one vector per input."""
    outputs: list[Literal["dense", "sparse", "colbert", "tokens"]] | None = Field(None, min_length=1)
    """The outputs of each input, from one forward (default: dense; sparse for a SPLADE model). ``sparse``
    (lexical weights) and ``colbert`` (one vector per token) need a model with those heads (bge-m3, SPLADE);
    ``tokens``: every token's last hidden state, special tokens included (any embedding model); see
    docs/api.md."""
    sparse_tokens: StrictBool = False
    """With a sparse output: also each token id's token, as ``sparse.tokens``."""
    max_active_dims: TokenCount | None = None
    """With a sparse output: keep only the N largest weights (sentence-transformers' max_active_dims)."""
    sparse_threshold: Threshold | None = None
    """With a sparse output: drop the weights below it (applied before max_active_dims)."""
    cache: StrictBool = True
    """false: this request neither reads nor fills the server's output cache (--cache-bytes)."""

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_input(v)


class TeiInputsRequest(BaseModel):
    """The input fields text-embeddings-inference's routes share (POST /embed_all takes only these)."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    inputs: Annotated[list[str] | list[list[int]], EMBED_INPUT]
    model: str | None = None
    truncate: StrictBool | None = None
    truncation_direction: Literal["right", "left"] = "right"
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return check_input(v)


class EmbedAllRequest(TeiInputsRequest):
    """POST /embed_all (text-embeddings-inference's route): every token's vector, without pooling."""


class SparseEmbedRequest(TeiInputsRequest):
    """POST /embed_sparse (text-embeddings-inference's route): lexical weights only."""

    max_active_dims: TokenCount | None = None
    """Keep only the N largest weights (sentence-transformers' max_active_dims)."""
    sparse_threshold: Threshold | None = None
    """Drop the weights below it (applied before max_active_dims)."""


class TokenizeRequest(BaseModel):
    """POST /tokenize: the ids /v1/embeddings would embed."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    input: Annotated[list[str], TEXT_INPUT]
    model: str | None = None
    truncate: StrictBool | None = None
    truncation_direction: Literal["right", "left"] = "right"
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_texts(v, "must be a string or a list of strings")


def embed_options(body: EmbeddingRequest) -> EmbedOptions:
    """The engine's options for an embeddings request."""
    return EmbedOptions(
        body.truncate,
        body.truncation_direction,
        body.normalize,
        body.dimensions,
        body.prompt_name,
        body.prompt,
        outputs=frozenset(body.outputs) if body.outputs else None,  # None: the model's default
        max_active_dims=body.max_active_dims,
        sparse_threshold=body.sparse_threshold,
        chunking=chunk_options(body.chunking, body.late_chunking),
        cache=body.cache,
    )


def chunk_options(c: Chunking | None, late_chunking: bool) -> ChunkOptions | None:
    """The engine's chunking options (a request's `chunking` and `late_chunking`, on /v1/embeddings and
    Cohere's /v2/embed): windows of long inputs (engine/chunking.py) or late chunking (engine/late.py:
    `chunking.mode` "late", or Jina's `late_chunking`)."""
    if late_chunking:
        if c is not None:
            raise InvalidInputError(
                "late_chunking: true and chunking are two ways to ask; send one", "chunking"
            )
        return ChunkOptions(True, mode="late", joined=True)
    if c is None:
        return None
    spans = None if c.spans is None else tuple((s, e) for s, e in c.spans)
    if c.mode == "window" and (spans is not None or c.size is not None or c.context_overlap is not None):
        raise InvalidInputError(
            'chunking.spans, size and context_overlap apply to "mode": "late"', "chunking.mode"
        )
    return ChunkOptions(c.enabled, c.overlap, c.return_chunks, c.mode, spans, c.size, c.context_overlap)


def sparse_options(body: SparseEmbedRequest) -> EmbedOptions:
    """The engine's options for an /embed_sparse request: the sparse output only."""
    return EmbedOptions(
        body.truncate,
        body.truncation_direction,
        prompt_name=body.prompt_name,
        prompt=body.prompt,
        outputs=frozenset({"sparse"}),
        max_active_dims=body.max_active_dims,
        sparse_threshold=body.sparse_threshold,
    )


def tokens_options(body: EmbedAllRequest) -> EmbedOptions:
    """The engine's options for an /embed_all request: the token-level output only."""
    return EmbedOptions(
        body.truncate,
        body.truncation_direction,
        prompt_name=body.prompt_name,
        prompt=body.prompt,
        outputs=frozenset({"tokens"}),
    )


def tokenize_options(body: TokenizeRequest) -> EmbedOptions:
    """The engine's options for a tokenize request: prompt and truncation, as embed applies them."""
    return EmbedOptions(
        body.truncate, body.truncation_direction, prompt_name=body.prompt_name, prompt=body.prompt
    )


@dataclass
class EmbedCall:
    """An embeddings request checked against the model it goes to, before any work: the engine's options,
    the output kinds it asks for, and the int8/uint8 ranges its vectors are encoded with."""

    body: EmbeddingRequest
    opts: EmbedOptions
    kinds: frozenset[str]
    ranges: np.ndarray | None


def embed_call(body: EmbeddingRequest, engine: ServingEngine) -> EmbedCall:
    """The options, then what is sized by them: the output dimension, the kinds the model gives (one it
    lacks is refused), the encoding fields that apply to them, and the encodings' ranges."""
    opts = embed_options(body)
    dimension = output_dimension(body.dimensions, engine.spec.dimension)
    kinds = engine.output_request(opts.outputs).kinds
    encodings.check_applies(kinds, body.embed_dtype, body.dimensions, body.embed_ranges)
    ranges = encodings.check_ranges(body.embed_dtype, body.embed_ranges, dimension)
    return EmbedCall(body, opts, kinds, ranges)
