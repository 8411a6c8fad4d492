"""Request bodies, validated strictly so every malformed field is a clear 400, and the response bodies.

The routes parse bodies by hand (orjson, a size limit while reading, 400 never 422); these models validate
what was parsed and describe the API in /openapi.json. `input` is checked by `_check_input`, which accepts
more shapes than the annotation says, so its JSON Schema is given explicitly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
)

from embed_service.api.encodings import EmbedDtype

_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"type": "array", "minItems": 1, "items": _TEXT}
_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}
EMBED_INPUT = WithJsonSchema(
    {
        "anyOf": [_TEXT, _TEXTS, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}],
        "description": "A text, a list of texts, a list of token ids, or a list of token-id lists. At most "
        "--max-client-batch-size inputs; token ids must lie in the model's vocabulary.",
    }
)
TEXT_INPUT = WithJsonSchema({"anyOf": [_TEXT, _TEXTS], "description": "A text or a list of texts."})

# The bounds of every number a request may send, checked when the body is validated, before anything is
# computed from it (a `dimensions` of 2**32 once sized an allocation), and stated in /openapi.json so that
# fuzzers generate at the edges. Each is a ceiling no model or request reaches; the model-specific checks
# (a model's dimension, its max input length) come after, with their own messages.
MAX_DIMENSIONS = 65_536
"""`dimensions`, `output_dimension`: no served model has more features."""
MAX_TOKENS = 2**24
"""Token counts and vocabulary-sized counts (`max_active_dims`, `chunking.overlap`): 16,777,216."""
MAX_INT32 = 2**31 - 1
"""Counts that only cut or slice (`top_n`, `max_tokens_per_doc`, Cohere's `max_tokens`, `priority`)."""
MAX_FLOAT32 = 3.4028234663852886e38
"""float32's largest finite value: the ceiling of every float field."""


def _in_range(lo: int, hi: int) -> AfterValidator:
    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError(f"must be in {lo}..{hi}, got {v}")
        return v

    return AfterValidator(check)


def _integers(lo: int, hi: int) -> WithJsonSchema:
    return WithJsonSchema({"type": "integer", "minimum": lo, "maximum": hi})


# Integer fields (a float or a bool is refused): the bounds enforced and stated in the JSON Schema.
Dimensions = Annotated[StrictInt, _in_range(1, MAX_DIMENSIONS), _integers(1, MAX_DIMENSIONS)]
TokenCount = Annotated[StrictInt, _in_range(1, MAX_TOKENS), _integers(1, MAX_TOKENS)]
Overlap = Annotated[StrictInt, _in_range(0, MAX_TOKENS), _integers(0, MAX_TOKENS)]
Cut = Annotated[StrictInt, _in_range(1, MAX_INT32), _integers(1, MAX_INT32)]
CharOffset = Annotated[StrictInt, _in_range(0, MAX_INT32), _integers(0, MAX_INT32)]
Priority = Annotated[StrictInt, _in_range(-MAX_INT32 - 1, MAX_INT32), _integers(-MAX_INT32 - 1, MAX_INT32)]


def _finite_non_negative(v: float) -> float:
    if not 0 <= v <= MAX_FLOAT32:  # NaN fails both comparisons
        raise ValueError(f"must be a finite number >= 0, got {v}")
    return v


Threshold = Annotated[
    StrictFloat | StrictInt,
    AfterValidator(_finite_non_negative),
    WithJsonSchema({"type": "number", "minimum": 0, "maximum": MAX_FLOAT32}),
]
"""A weight threshold: a finite number >= 0 (float32's largest at most)."""


def _check_input(v: Any) -> list[str] | list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists -> a list of inputs."""
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, list):
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if not v:
        raise ValueError("must not be empty")
    first = v[0]
    if isinstance(first, str):
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise ValueError(f"item {i} is not a string; a list of inputs must not mix types")
            if not s:
                raise ValueError(f"item {i} is an empty string")
        return v
    if _is_int(first):
        if not all(_is_int(t) for t in v):
            raise ValueError("a list of token ids must hold integers only")
        return [v]
    if isinstance(first, list):
        for i, seq in enumerate(v):
            if not isinstance(seq, list) or not all(_is_int(t) for t in seq):
                raise ValueError(f"item {i} is not a list of integer token ids")
            if not seq:
                raise ValueError(f"item {i} is an empty list of token ids")
        return v
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


_NUMBER = {"type": "number", "minimum": -MAX_FLOAT32, "maximum": MAX_FLOAT32}
_NUMBERS = {"type": "array", "minItems": 1, "maxItems": MAX_DIMENSIONS, "items": _NUMBER}
_PerDimension = Annotated[list[StrictFloat | StrictInt], Field(min_length=1, max_length=MAX_DIMENSIONS)]
EmbedRanges = Annotated[
    tuple[StrictFloat | StrictInt, StrictFloat | StrictInt] | tuple[_PerDimension, _PerDimension],
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "minItems": 2, "maxItems": 2, "items": _NUMBER},
                {"type": "array", "minItems": 2, "maxItems": 2, "items": _NUMBERS},
            ],
            "description": "[low, high] for every dimension, or [[lows...], [highs...]] with one per "
            "output dimension; each low at most its high, all finite float32 numbers.",
        }
    ),
]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


Span = Annotated[
    tuple[CharOffset, CharOffset],
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT32},
            "description": "[start, end): characters of the input.",
        }
    ),
]


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

    input: Annotated[list[str] | list[list[int]], EMBED_INPUT]
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
    outputs: list[Literal["dense", "sparse", "colbert"]] | None = Field(None, min_length=1)
    """The outputs of each input, from one forward (default: dense; sparse for a SPLADE model). ``sparse``
    (lexical weights) and ``colbert`` (one vector per token) need a model with those heads (bge-m3, SPLADE);
    see docs/api.md."""
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
        return _check_input(v)


class SparseEmbedRequest(BaseModel):
    """POST /embed_sparse (text-embeddings-inference's route): lexical weights only."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    inputs: Annotated[list[str] | list[list[int]], EMBED_INPUT]
    model: str | None = None
    truncate: StrictBool | None = None
    truncation_direction: Literal["right", "left"] = "right"
    prompt_name: StrictStr | None = None
    prompt: StrictStr | None = None
    max_active_dims: TokenCount | None = None
    """Keep only the N largest weights (sentence-transformers' max_active_dims)."""
    sparse_threshold: Threshold | None = None
    """Drop the weights below it (applied before max_active_dims)."""

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return _check_input(v)


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
        out = _check_input(v)
        if not isinstance(out[0], str):
            raise ValueError("must be a string or a list of strings")
        return out


# Responses (documentation only: the routes write their bodies with orjson).


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: the OpenAI shape."""

    error: ErrorDetail


class Chunk(BaseModel):
    """One window of a chunked text, or one late chunk."""

    start: int
    """The first character of the text the window's tokens cover (a late chunk: its span's start)."""
    end: int
    """One past the last character covered."""
    tokens: int
    """The window's text tokens (its weight in the average); a late chunk's tokens pooled."""
    embedding: list[float] | str


class SparseVector(BaseModel):
    indices: list[int]
    """Token ids, ascending."""
    values: list[float]
    """Their weights (> 0), the largest per token id."""
    tokens: list[str] | None = None
    """The tokens of `indices`, with ``sparse_tokens: true``."""


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str | None = None
    """Numbers (integers for the integer and bit embed_dtypes), or with ``encoding_format: base64`` the
    base64 of the vector's little-endian bytes. Present when the dense output was asked for (the default)."""
    chunks: list[Chunk] | None = None
    """With ``chunking.return_chunks``: the windows, in order; with ``"mode": "late"``: the late chunks, in
    the order of ``chunking.spans`` (or of the text, for ``size``)."""
    sparse: SparseVector | None = None
    """With ``outputs`` naming ``sparse``."""
    colbert: list[list[float]] | list[str] | None = None
    """With ``outputs`` naming ``colbert``: one normalized vector per token after the first, as floats or
    (``encoding_format: base64``) one base64 string each."""


class SparseValue(BaseModel):
    index: int
    """A token id."""
    value: float
    """Its weight."""


class SparseEmbedResponse(RootModel[list[list[SparseValue]]]):
    """POST /embed_sparse: per input, its (token id, weight) pairs, ascending ids."""


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class TokenizedInput(BaseModel):
    index: int
    tokens: list[int]
    count: int


class TokenizeResponse(BaseModel):
    data: list[TokenizedInput]
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Info(BaseModel):
    """What the server detected and resolved; see docs/api.md for every field."""

    model_config = ConfigDict(extra="allow")

    model: str
    served_model_names: list[str]
    dimension: int
    max_input_length: int
    state: str
    version: str


class Health(BaseModel):
    status: Literal["ok", "loading", "draining", "restarting", "unhealthy"]
    reason: str | None = None
    models: dict[str, str] | None = None
    """With several models, each one's state (``loading``, ``ready``, ``restarting``, ...), by canonical name."""


class Live(BaseModel):
    status: Literal["alive"]


# Cohere's embed API (POST /v2/embed and /v1/embed): api/cohere.py; docs/api.md says what maps to what.

CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereContent(BaseModel):
    """One part of a Cohere input; only text parts can be embedded here."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: StrictStr | None = None


class CohereInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: list[CohereContent] = Field(min_length=1)


class CohereEmbedRequest(BaseModel):
    """POST /v2/embed (and /v1/embed), per Cohere's API, plus ``embed_ranges``."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    texts: Annotated[list[str] | None, WithJsonSchema({**_TEXTS, "description": "The texts to embed."})] = (
        None
    )
    inputs: list[CohereInput] | None = Field(None, min_length=1)
    """Instead of texts: inputs of text parts (the parts of one input are joined by newlines)."""
    images: list[Any] | None = None
    """Refused when not empty: only text models are served."""
    input_type: Literal["search_query", "search_document", "classification", "clustering", "image"] | None = (
        None
    )
    """Selects the model's prompt of that purpose (docs/api.md); ``image`` is refused."""
    embedding_types: list[CohereEmbeddingType] | None = Field(None, min_length=1)
    """The encodings to return, each under its own key; default ``["float"]``."""
    output_dimension: Dimensions | None = None
    """Keep the first N features (at most the model's dimension), then re-normalize."""
    truncate: Literal["NONE", "START", "END"] | None = None
    """END (default): cut the end of a long input; START: cut its start; NONE: refuse it (400)."""
    max_tokens: Cut | None = None
    """Accepted only when at least the model's max input length (which is what applies)."""
    priority: Priority | None = None
    """Accepted and ignored."""
    embed_ranges: EmbedRanges | None = None
    """int8/uint8 only: as on /v1/embeddings. Default [-1, 1] for every dimension."""

    @field_validator("texts", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        if not isinstance(v, list):  # null included: leave texts out to send inputs
            raise ValueError("must be a list of strings")
        out = _check_input(v)
        if not isinstance(out[0], str):
            raise ValueError("must be a list of strings")
        return out


class CohereEmbeddings(BaseModel):
    """One list per asked-for type, each with a vector per input."""

    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None
    """Each vector's little-endian float32 bytes."""


class CohereBilledUnits(BaseModel):
    input_tokens: int


class CohereMeta(BaseModel):
    api_version: dict[str, str]
    billed_units: CohereBilledUnits
    tokens: CohereBilledUnits


class CohereEmbedResponse(BaseModel):
    """``embeddings_by_type`` (every /v2/embed answer, and /v1/embed's with embedding_types), or
    ``embeddings_floats`` (/v1/embed without embedding_types: the float vectors as a list)."""

    response_type: Literal["embeddings_by_type", "embeddings_floats"]
    id: str
    embeddings: CohereEmbeddings | list[list[float]]
    texts: list[str]
    meta: CohereMeta
