"""The response bodies (documentation: the routes write them with orjson) and Cohere's embed request.

The request bodies the routes share with the Python API are in requests/ (requests/embed.py,
requests/score.py); the routes parse bodies by hand (orjson, a size limit while reading, 400 never 422),
those models validate what was parsed, and all of them describe the API in /openapi.json.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictStr,
    WithJsonSchema,
    field_validator,
)

from embed_service.requests.embed import Chunking
from embed_service.requests.fields import TEXTS_SCHEMA, Cut, Dimensions, EmbedRanges, Priority, check_texts

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
    tokens: list[list[float]] | list[str] | None = None
    """With ``outputs`` naming ``tokens``: every token's last hidden state (special tokens included, before
    pooling and Dense layers), float32, as floats or (``encoding_format: base64``) one base64 string each."""


class SparseValue(BaseModel):
    index: int
    """A token id."""
    value: float
    """Its weight."""


class SparseEmbedResponse(RootModel[list[list[SparseValue]]]):
    """POST /embed_sparse: per input, its (token id, weight) pairs, ascending ids."""


class EmbedAllResponse(RootModel[list[list[list[float]]]]):
    """POST /embed_all: per input, one vector per token (its last hidden state)."""


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
    """One part of a Cohere input: a text, or an image (an image model only)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: StrictStr | dict[str, Any] | None = None
    """``{"url": "data:image/...;base64,..."}`` (or the data URL itself)."""


class CohereInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: list[CohereContent] = Field(min_length=1)


class CohereEmbedRequest(BaseModel):
    """POST /v2/embed (and /v1/embed), per Cohere's API, plus ``embed_ranges``."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    model: str | None = None
    """A served model name; default: the first served model."""
    texts: Annotated[
        list[str] | None, WithJsonSchema({**TEXTS_SCHEMA, "description": "The texts to embed."})
    ] = None
    inputs: list[CohereInput] | None = Field(None, min_length=1)
    """Instead of texts: inputs of text parts (the parts of one input are joined by newlines)."""
    images: list[StrictStr] | None = None
    """Images as data URIs (``data:image/png;base64,...``), with ``input_type: "image"``: an image model
    (CLIP, SigLIP) only. Instead of texts and inputs."""
    input_type: Literal["search_query", "search_document", "classification", "clustering", "image"] | None = (
        None
    )
    """Selects the model's prompt of that purpose (docs/api.md); ``image`` goes with ``images``."""
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
    chunking: Chunking | None = None
    """As on /v1/embeddings: long texts as averaged windows, or late chunking (``"mode": "late"``: each
    text's chunks in ``chunks``)."""
    late_chunking: StrictBool = False
    """Jina's late chunking: the texts are the consecutive chunks of one document, embedded in one forward
    pass; one vector per text."""

    @field_validator("texts", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        if not isinstance(v, list):  # null included: leave texts out to send inputs
            raise ValueError("must be a list of strings")
        return check_texts(v, "must be a list of strings")


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


class CohereEmbedding(BaseModel):
    """One vector per asked-for type (a chunk's)."""

    model_config = ConfigDict(populate_by_name=True)

    float_: list[float] | None = Field(None, alias="float")
    int8: list[int] | None = None
    uint8: list[int] | None = None
    binary: list[int] | None = None
    ubinary: list[int] | None = None
    base64: str | None = None


class CohereChunk(BaseModel):
    """One late chunk (or window) of a text: its character span, its tokens and its vector per type."""

    start: int
    end: int
    tokens: int
    embeddings: CohereEmbedding


class CohereEmbedResponse(BaseModel):
    """``embeddings_by_type`` (every /v2/embed answer, and /v1/embed's with embedding_types), or
    ``embeddings_floats`` (/v1/embed without embedding_types: the float vectors as a list)."""

    response_type: Literal["embeddings_by_type", "embeddings_floats"]
    id: str
    embeddings: CohereEmbeddings | list[list[float]]
    texts: list[str]
    meta: CohereMeta
    chunks: list[list[CohereChunk]] | None = None
    """With ``chunking`` (late, or windows with ``return_chunks``): per text its chunks."""
