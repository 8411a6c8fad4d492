"""Compact encodings of the final vectors: half precision, int8/uint8 and packed bits, as numbers or bytes.

Pure numpy, applied to what the engine returns (sliced to `dimensions` and normalized already), so the
order is always slice, re-normalize, then quantize: 128 dimensions as ``ubinary`` are 16 bytes.

The integer and bit types follow sentence-transformers' ``quantize_embeddings`` operation for operation
(float32 arithmetic, the same floor and clip), so a client that quantized the float vectors itself gets
the same codes:

- ``binary`` / ``ubinary``: the sign bits (``> 0``) packed 8 dimensions per byte, most significant bit
  first (``np.packbits``); ``binary`` is ``ubinary - 128`` as int8. A dimension count that is not a
  multiple of 8 is padded with zero bits in the last byte (what ``np.packbits`` does): the padding is the
  same in every vector, so Hamming distances are unchanged.
- ``int8`` / ``uint8``: 256 buckets between a low and a high value per dimension,
  ``clip(floor((x - low) / ((high - low) / 255)), 0, 255)``, minus 128 for int8. sentence-transformers
  takes the ranges from calibration embeddings, or by default from the batch being quantized, which
  would make a vector's code depend on the other inputs of its request. A service needs codes that do
  not, so the ranges are fixed: by default ``[-1, 1]`` in every dimension, which holds every component of
  a unit vector (nothing clips), or what the request sends in ``embed_ranges``: one ``[low, high]`` pair
  for all dimensions, or a ``[[low...], [high...]]`` pair of per-dimension lists (the ranges
  sentence-transformers computes from a calibration set: ``np.stack([emb.min(0), emb.max(0)])``), which
  spend the 256 levels where the values are.
- ``float16``: IEEE half precision, rounded to nearest. ``bfloat16``: the top 16 bits of the float32,
  rounded to nearest even (as torch's conversion), computed on the bits since numpy has no bfloat16.

JSON numbers: floats for the float types (each the exact value of the 16-bit number), integers for the
integer and bit types. base64: the raw little-endian bytes of each vector (2 bytes a value for the 16-bit
floats, 1 byte a value for int8/uint8, 1 byte per 8 dimensions for the bit types).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from embed_service.engine.errors import InvalidInputError

EmbedDtype = Literal["float32", "float16", "bfloat16", "int8", "uint8", "binary", "ubinary"]
EMBED_DTYPES: tuple[str, ...] = EmbedDtype.__args__  # type: ignore[attr-defined]
INTEGER_DTYPES = ("int8", "uint8")
DEFAULT_RANGE = (-1.0, 1.0)

# The numpy type each encoding's values are stored and sent as (bfloat16: its bit pattern as uint16).
_STORAGE = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int8": "i1",
    "uint8": "u1",
    "binary": "i1",
    "ubinary": "u1",
}


class EncodingError(InvalidInputError):
    """A request whose encoding cannot be applied (a 400); ``param`` names the field at fault."""


def ranges_for(embed_ranges: Sequence[Any] | None, dimension: int) -> np.ndarray:
    """`embed_ranges` as sent (None, ``[low, high]`` or ``[[low...], [high...]]``) -> (2, dimension)
    float32, checked against the vectors' dimension (after `dimensions`)."""
    if embed_ranges is None:
        embed_ranges = list(DEFAULT_RANGE)
    if all(isinstance(v, (int, float)) for v in embed_ranges):
        ranges = np.repeat(np.asarray(embed_ranges, dtype=np.float64).reshape(2, 1), dimension, axis=1)
    else:
        lengths = {len(row) for row in embed_ranges}
        if lengths != {dimension}:
            raise EncodingError(
                f"embed_ranges must hold {dimension} lows and {dimension} highs, one per output dimension "
                f"(after dimensions), got lists of {sorted(lengths)}",
                "embed_ranges",
            )
        ranges = np.asarray(embed_ranges, dtype=np.float64)
    if not np.isfinite(ranges).all() or not np.isfinite(ranges.astype(np.float32)).all():
        raise EncodingError("embed_ranges must be finite float32 numbers", "embed_ranges")
    if (ranges[0] > ranges[1]).any():
        raise EncodingError("embed_ranges: each low must not exceed its high", "embed_ranges")
    return ranges.astype(np.float32)


def _bfloat16_bits(vectors: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even. The vectors are finite."""
    bits = np.ascontiguousarray(vectors, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode(vectors: np.ndarray, dtype: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """(n, d) float32 -> (n, d) of the type's storage, or (n, ceil(d / 8)) bytes for the bit types.

    `ranges`: (2, d) float32 lows and highs for int8/uint8 (default: DEFAULT_RANGE everywhere).
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    if dtype == "float32":
        return vectors
    if dtype == "float16":
        return vectors.astype(np.float16)
    if dtype == "bfloat16":
        return _bfloat16_bits(vectors)
    if dtype in INTEGER_DTYPES:
        if ranges is None:
            ranges = ranges_for(None, vectors.shape[1])
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets: np.ndarray = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        if dtype == "uint8":
            return buckets.astype(np.uint8)
        return (buckets - 128).astype(np.int8)
    if dtype in ("binary", "ubinary"):
        packed = np.packbits(vectors > 0, axis=-1)
        if dtype == "ubinary":
            return packed
        return (packed.astype(np.int16) - 128).astype(np.int8)
    raise EncodingError(f"unknown embed_dtype {dtype!r}; one of {', '.join(EMBED_DTYPES)}", "embed_dtype")


def json_rows(encoded: np.ndarray, dtype: str) -> np.ndarray:
    """What orjson writes as JSON numbers: floats for the float types, integers for the others.

    bfloat16 goes out as the float32 of the same value (its bits shifted back up): exact, and numpy
    can print it.
    """
    if dtype == "bfloat16":
        return (encoded.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return encoded


def base64_rows(encoded: np.ndarray, dtype: str = "float32") -> list[str]:
    """(n, k) encoded -> one base64 string of the row's little-endian bytes per row.

    When a row is a whole number of 3-byte groups (384 float32, 768 float16 ...) the base64 of the whole
    buffer is the rows' base64 strings laid end to end, so one encode over the buffer and string slices
    replace n encodes.
    """
    raw = np.ascontiguousarray(encoded, dtype=_STORAGE[dtype])
    n = raw.shape[0]
    row_bytes = raw.shape[1] * raw.itemsize
    if row_bytes % 3:
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in raw]
    text = base64.b64encode(raw.data).decode("ascii")
    step = row_bytes // 3 * 4
    return [text[i * step : (i + 1) * step] for i in range(n)]


def rows(vectors: np.ndarray, dtype: str, encoding_format: str | None, ranges: np.ndarray | None) -> Any:
    """The per-vector values of a response: base64 strings, or arrays orjson writes as JSON numbers."""
    encoded = encode(vectors, dtype, ranges)
    if encoding_format == "base64":
        return base64_rows(encoded, dtype)
    return json_rows(encoded, dtype)


def check_applies(
    kinds: frozenset[str], dtype: str, dimensions: int | None, embed_ranges: Sequence[Any] | None
) -> None:
    """The encoding fields shape dense vectors only: sent with no dense output asked for (a SPLADE model's
    default, ``outputs: ["sparse"]``), or `embed_dtype` beside ColBERT vectors (sent as float32), they are
    refused rather than ignored."""
    if "dense" not in kinds:
        given = [
            name
            for name, value in (
                ("dimensions", dimensions is not None),
                ("embed_dtype", dtype != "float32"),
                ("embed_ranges", embed_ranges is not None),
            )
            if value
        ]
        if given:
            raise EncodingError(
                f"{given[0]} applies to the dense output, which this request does not ask for (its outputs: "
                f"{', '.join(sorted(kinds))}); leave it out",
                given[0],
            )
    if "colbert" in kinds and dtype != "float32":
        raise EncodingError(
            f"embed_dtype {dtype} applies to dense vectors only and ColBERT vectors are sent as float32: ask "
            "for the colbert output in a request with embed_dtype float32",
            "embed_dtype",
        )


def check_ranges(dtype: str, embed_ranges: Sequence[Any] | None, dimension: int) -> np.ndarray | None:
    """The (2, dimension) ranges for an integer type; `embed_ranges` with any other type is refused."""
    if dtype in INTEGER_DTYPES:
        return ranges_for(embed_ranges, dimension)
    if embed_ranges is not None:
        raise EncodingError(
            f"embed_ranges applies to embed_dtype int8 and uint8, not {dtype}", "embed_ranges"
        )
    return None
