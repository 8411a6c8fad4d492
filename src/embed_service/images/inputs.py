"""Image inputs as the routes and the Python API take them, to what the batcher carries.

An input item is a text or an image: a plain string, or an object in one of the shapes other servers take,
the OpenAI chat content part (``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}``, the url also as a bare string) and Jina's (``{"text": ...}``,
``{"image": "<data URL or base64>"}``); a URL instead of the data is fetched from an allowed host only
(fetch.py). An image becomes pixel values here, in the front end (decode.py,
preprocess.py), bounded before it is paid for; the batcher carries it as a sequence of placeholder ids as
long as its vision-tower tokens (its cost), its pixels in its OutputRequest.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from embed_service.images.decode import (
    ImageError,
    ImageLimits,
    RequestBudget,
    decode_base64,
    load_rgb,
)
from embed_service.images.fetch import FetchError, FetchPolicy, fetch, is_url
from embed_service.images.preprocess import ImageProcessor

TEXT, IMAGE = "text", "image"


@dataclass(frozen=True)
class ImageInput:
    """One image among a request's inputs: a data URL, base64 or an http(s) URL of an allowed host (the
    routes), or bytes, a path or a PIL image (the Python API). A request's input list holds these beside
    its texts."""

    source: Any


class InputItemError(ValueError):
    """An input item of no known shape."""


def classify(item: Any, what: str) -> tuple[str, Any]:
    """(TEXT, str) or (IMAGE, source) for one input item; the source is a data URL or base64 string."""
    if isinstance(item, str):
        return TEXT, item
    if not isinstance(item, dict):
        raise InputItemError(f"{what}: expected a string or an object with a text or an image")
    kind = item.get("type")
    if kind == "text" and isinstance(item.get("text"), str):
        return TEXT, item["text"]
    if kind == "image_url":
        url = item.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str):
            return IMAGE, url
        raise InputItemError(
            f'{what}: an image_url part needs "image_url": {{"url": "data:image/...;base64,..."}}'
        )
    if kind is None and set(item) == {"text"} and isinstance(item["text"], str):
        return TEXT, item["text"]
    if kind is None and set(item) == {"image"} and isinstance(item["image"], str):
        return IMAGE, item["image"]
    raise InputItemError(
        f'{what}: unknown input object; send a string, {{"type": "text", "text": ...}}, {{"type": "image_url", '
        '"image_url": {"url": ...}}, {"text": ...} or {"image": ...}'
    )


@dataclass
class ImageStats:
    """What one request's images cost: counted into the metrics by the caller."""

    images: int = 0
    bytes: int = 0
    decode_seconds: float = 0.0
    fetches: Counter[str] = field(default_factory=Counter)
    """URLs fetched, by result: ``ok`` or a FetchError's reason."""


@dataclass
class ImagePreparer:
    """One model's image inputs to pixel values (float32 (3, H, W) bytes), within `limits`."""

    processor: ImageProcessor
    tokens_per_image: int
    limits: ImageLimits = field(default_factory=ImageLimits)
    fetching: FetchPolicy = field(default_factory=FetchPolicy)
    """Which URLs may be fetched (fetch.py); by default none."""

    def request(self) -> RequestBudget:
        return RequestBudget(self.limits)

    def pixels(self, source: Any, what: str, budget: RequestBudget, stats: ImageStats | None = None) -> bytes:
        """A data URL / base64 string, raw bytes, a path, or a PIL image -> preprocessed pixel bytes.

        Strings, bytes and paths are encoded images: decoded as transformers' load_image decodes them (EXIF
        orientation, RGB). A PIL image is taken as it is, as the image processor takes it.
        """
        t0 = time.perf_counter()
        if isinstance(source, Image.Image):
            width, height = source.size
            if width * height > self.limits.max_pixels:
                raise ImageError(
                    f"{what}: {width}x{height} = {width * height} pixels; the limit is "
                    f"{self.limits.max_pixels} pixels (--max-image-pixels)"
                )
            budget.take_pixels(width, height, what)
            picture = source
            size = 0
        else:
            data = self._fetched(source, what, budget, stats)
            budget.take(len(data), what)
            picture, size = load_rgb(data, what, self.limits, budget), len(data)
        out = self.processor(picture).tobytes()
        if stats is not None:
            stats.images += 1
            stats.bytes += size
            stats.decode_seconds += time.perf_counter() - t0
        return out

    def placeholder(self) -> list[int]:
        """The ids an image's sequence carries through the batcher: as many as its vision-tower tokens."""
        return [0] * self.tokens_per_image

    def fetches(self, source: Any) -> bool:
        """Whether `source` is a URL this preparer would fetch (so it is worth a thread of its own)."""
        return bool(self.fetching.domains) and isinstance(source, str) and is_url(source)

    def _fetched(self, source: Any, what: str, budget: RequestBudget, stats: ImageStats | None) -> bytes:
        """`_bytes`, with a fetch's result counted in `stats`."""
        if stats is None or not self.fetches(source):
            return self._bytes(source, what, budget)
        try:
            data = self._bytes(source, what, budget)
        except FetchError as e:
            stats.fetches[e.reason] += 1
            raise
        stats.fetches["ok"] += 1
        return data

    def _bytes(self, source: Any, what: str, budget: RequestBudget) -> bytes:
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if isinstance(source, Path):
            size = source.stat().st_size
            if size > self.limits.max_bytes:
                raise ImageError(
                    f"{what}: {size} bytes; the limit is {self.limits.max_bytes} bytes per image (--max-image-bytes)"
                )
            return source.read_bytes()
        if isinstance(source, str) and is_url(source):
            # read no further than the image's limit, or what is left of the request's
            limits, left = self.limits, self.limits.max_request_bytes - budget.used
            if left < limits.max_bytes:
                text = (
                    f"the limit is {limits.max_request_bytes} bytes per request (--max-request-image-bytes)"
                )
                return fetch(
                    source, what, self.fetching, left, text, budget.fetch_deadline(self.fetching.timeout)
                )
            text = f"the limit is {limits.max_bytes} bytes per image (--max-image-bytes)"
            return fetch(
                source,
                what,
                self.fetching,
                limits.max_bytes,
                text,
                budget.fetch_deadline(self.fetching.timeout),
            )
        if isinstance(source, str):
            return decode_base64(source, what, self.limits)
        raise ImageError(f"{what}: an image must be a data URL, base64, bytes, a path or a PIL image")


def items(values: list[Any], what: str = "input") -> list[Any]:
    """A request's input items -> texts (str) and ImageInput, in order (see `classify`)."""
    out: list[Any] = []
    for i, item in enumerate(values):
        kind, value = classify(item, f"{what} {i}")
        out.append(value if kind == TEXT else ImageInput(value))
    return out


__all__ = [
    "IMAGE",
    "TEXT",
    "ImageError",
    "ImageInput",
    "ImagePreparer",
    "ImageStats",
    "InputItemError",
    "classify",
]
