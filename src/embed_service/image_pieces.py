"""A request's image budgets as `Embedder` cuts a long list of inputs into engine calls (embedder.pieces).

The server refuses one request whose images together pass ``--max-request-image-bytes`` or
``--max-request-image-pixels``; `Embedder.encode` (and so ``embed-service encode`` and the Ray integration)
takes any number of inputs, so it starts a new call before a piece would pass either budget. An image's cost
is read cheaply, before it is decoded: the size of its bytes or file and the pixels its header states. What
cannot be read costs nothing here: the decode refuses it, naming the input, as the server does.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

from PIL import Image

from embed_service.config import Settings
from embed_service.images.inputs import ImageInput


def image_cost(item: Any) -> tuple[int, int]:
    """(encoded bytes, pixels) of an image input, (0, 0) for a text or token ids."""
    if not isinstance(item, ImageInput):
        return 0, 0
    source = item.source
    if isinstance(source, Image.Image):
        return 0, source.size[0] * source.size[1]
    if isinstance(source, str):  # a data URL or base64: its decoded size, from its length
        return len(source) * 3 // 4, 0
    try:
        if isinstance(source, Path):
            size = os.stat(source).st_size
            return size, _header_pixels(source)
        data = bytes(source)
        return len(data), _header_pixels(io.BytesIO(data))
    except (OSError, TypeError, ValueError):
        return 0, 0


def _header_pixels(source: Any) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Image.open(source) as image:  # lazy: the header only
                return int(image.size[0] * image.size[1])
        except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
            return 0


class ImageRoom:
    """The image bytes and pixels of the piece being filled, against the request budgets of `settings`."""

    def __init__(self, settings: Settings):
        self.max_bytes, self.max_pixels = settings.max_request_image_bytes, settings.max_request_image_pixels
        self.bytes = self.pixels = 0
        self.last = (0, 0)

    def take(self, item: Any) -> bool:
        """Count `item` into the piece; False when the piece must end before it (then `restart`)."""
        self.last = image_cost(item)
        self.bytes += self.last[0]
        self.pixels += self.last[1]
        return self.bytes <= self.max_bytes and self.pixels <= self.max_pixels

    def restart(self) -> None:
        """A new piece, from the item `take` counted last."""
        self.bytes, self.pixels = self.last
