"""The fields of request bodies, shared by the HTTP routes and the Python API: the bounds of every number,
the integer and float field types that enforce them and state them in the JSON Schema, and `check_input`,
the one check of an ``input`` (which accepts more shapes than its annotation says, so its JSON Schema is
given explicitly: EMBED_INPUT, TEXT_INPUT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, cast

from pydantic import AfterValidator, Field, StrictFloat, StrictInt, WithJsonSchema

from embed_service.images.inputs import TEXT, ImageInput, InputItemError, classify

_TEXT = {"type": "string", "minLength": 1}
TEXTS_SCHEMA = {"type": "array", "minItems": 1, "items": _TEXT}
"""The JSON Schema of a list of texts."""
_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}
_IMAGE_URL = {"type": "string", "minLength": 1, "description": "data:image/...;base64,... (or bare base64)"}
_ITEM = {
    "anyOf": [
        _TEXT,
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _TEXT},
        },
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {
                    "anyOf": [
                        _IMAGE_URL,
                        {"type": "object", "required": ["url"], "properties": {"url": _IMAGE_URL}},
                    ]
                },
            },
        },
        {
            "type": "object",
            "required": ["text"],
            "properties": {"text": _TEXT},
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["image"],
            "properties": {"image": _IMAGE_URL},
            "additionalProperties": False,
        },
    ]
}
EMBED_INPUT = WithJsonSchema(
    {
        "anyOf": [
            _TEXT,
            TEXTS_SCHEMA,
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
            {"type": "array", "minItems": 1, "items": _ITEM},
        ],
        "description": "A text, a list of texts, a list of token ids, or a list of token-id lists; for an "
        "image model (CLIP, SigLIP) also a list of texts and images, as OpenAI content parts or Jina objects "
        "(docs/api.md, Images). At most --max-client-batch-size inputs; token ids must lie in the model's "
        "vocabulary.",
    }
)
TEXT_INPUT = WithJsonSchema({"anyOf": [_TEXT, TEXTS_SCHEMA], "description": "A text or a list of texts."})

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


def _image_object(v: Any) -> bool:
    """An image as the Python API takes it: bytes, a path, a PIL image (or one already wrapped)."""
    return isinstance(v, (bytes, bytearray, Path, ImageInput)) or type(v).__module__.startswith("PIL.")


def check_input(v: Any) -> list[str] | list[list[int]] | list[str | ImageInput]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists -> a list of inputs;
    a list of items with objects among them (content parts, Jina's objects; images in the Python API) -> its
    texts and ImageInputs, or its texts alone when it holds no image."""
    if _image_object(v):
        v = [v]
    if isinstance(v, list) and any(isinstance(x, dict) or _image_object(x) for x in v):
        return _items(v)
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
        return cast(list[str], v)
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
        return cast(list[list[int]], v)
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _items(v: list[Any]) -> list[str] | list[str | ImageInput]:
    out: list[str | ImageInput] = []
    for i, x in enumerate(v):
        if _image_object(x):
            out.append(x if isinstance(x, ImageInput) else ImageInput(x))
            continue
        try:
            kind, value = classify(x, f"item {i}")
        except InputItemError as exc:
            raise ValueError(str(exc)) from None
        if kind == TEXT and not value:
            raise ValueError(f"item {i} is an empty string")
        out.append(value if kind == TEXT else ImageInput(value))
    if not any(isinstance(x, ImageInput) for x in out):
        return cast(list[str], out)
    return out


def check_texts(v: Any, refusal: str) -> list[str]:
    """`check_input` for a field of texts only: token ids are refused with `refusal`."""
    out = check_input(v)
    if not all(isinstance(x, str) for x in out):  # token ids, or images
        raise ValueError(refusal)
    return cast(list[str], out)


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
