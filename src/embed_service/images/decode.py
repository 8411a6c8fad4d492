"""Image bytes to an RGB picture, every bound checked before it is paid for.

Order: the encoded size (per image, and the running total of a request) before anything is parsed; the
format from the file's signature (PNG, JPEG, WebP, GIF only: PIL tries no other decoder); the pixel count
from the header (``--max-image-pixels``), before a pixel is decoded, so a decompression bomb costs its
header; then the decode, where a corrupt or truncated file is refused rather than padded. GIF and animated
WebP give their first frame, as PIL (and so transformers) opens them.

Then the conversion the reference applies to an encoded image: ``transformers.image_utils.load_image`` (EXIF
orientation applied with ``ImageOps.exif_transpose``, then ``convert("RGB")``), followed by the image
processor's own RGB conversion (preprocess.to_rgb: transparency composited onto white), which is what a
transformers or sentence-transformers user gets from a file, a path or a base64 string. CMYK, palette,
16-bit, grey and alpha images go through those same PIL calls, so they convert exactly as there.

Every refusal is an ImageError naming the input and the limit; the API turns it into a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

# PIL's format names -> what error messages call them.
FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
REMOTE_REFUSED = (
    "remote image URLs are not fetched by default; send the image as a data URL or base64, or start the "
    "server with --allowed-media-domains HOST,... to fetch images from those hosts (docs/api.md#images)"
)


class ImageError(ValueError):
    """An image input refused: the message names the input and the limit or the fault."""


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = 4096 * 4096
    """Decoded pixels (width x height, read from the header) per image: ``--max-image-pixels``."""
    max_bytes: int = 20 << 20
    """Encoded bytes per image: ``--max-image-bytes``."""
    max_request_bytes: int = 64 << 20
    """Encoded bytes of all the images of one request: ``--max-request-image-bytes``."""
    max_request_pixels: int = 1 << 28
    """Decoded pixels of all the images of one request (what their decoding costs, since a small file can
    hold a large picture): ``--max-request-image-pixels``."""


class RequestBudget:
    """The running totals of one request's encoded image bytes and decoded pixels."""

    def __init__(self, limits: ImageLimits):
        self.limits, self.used, self.pixels = limits, 0, 0
        self._fetch_deadline: float | None = None

    def fetch_deadline(self, timeout: float) -> float:
        """The time.monotonic() by which all of the request's URL fetches must be done: `timeout` seconds
        after its first one started."""
        if self._fetch_deadline is None:
            self._fetch_deadline = time.monotonic() + timeout
        return self._fetch_deadline

    def take_pixels(self, width: int, height: int, what: str) -> None:
        """Checked from the header, before the pixels are decoded."""
        self.pixels += width * height
        if self.pixels > self.limits.max_request_pixels:
            raise ImageError(
                f"{what}: the request's images reach {self.pixels} pixels; the limit is "
                f"{self.limits.max_request_pixels} pixels per request (--max-request-image-pixels)"
            )

    def take(self, size: int, what: str) -> None:
        if size > self.limits.max_bytes:
            raise ImageError(
                f"{what}: {size} bytes; the limit is {self.limits.max_bytes} bytes per image (--max-image-bytes)"
            )
        self.used += size
        if self.used > self.limits.max_request_bytes:
            raise ImageError(
                f"{what}: the request's images reach {self.used} bytes; the limit is "
                f"{self.limits.max_request_bytes} bytes per request (--max-request-image-bytes)"
            )


def decode_base64(text: str, what: str, limits: ImageLimits) -> bytes:
    """A data URL (``data:image/png;base64,...``) or bare base64 to bytes, its size checked from the text's
    length before it is decoded."""
    if text.startswith(("http://", "https://")):
        raise ImageError(f"{what}: {REMOTE_REFUSED}")
    payload = text
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        media = header[5:].split(";")[0].strip().lower()
        if not sep or ";base64" not in header.lower():
            raise ImageError(f"{what}: a data URL must be base64 encoded (data:image/png;base64,...)")
        if media not in MEDIA_TYPES:
            raise ImageError(
                f"{what}: media type {media or 'none'!r}; allowed: image/png, image/jpeg, image/webp, image/gif"
            )
    payload = "".join(payload.split())  # line breaks and spaces, as base64.decodebytes allows
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError(
            f"{what}: about {len(payload) * 3 // 4} bytes; the limit is {limits.max_bytes} bytes per image "
            "(--max-image-bytes)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what}: not valid base64") from None


def open_checked(
    data: bytes, what: str, limits: ImageLimits, budget: RequestBudget | None = None
) -> Image.Image:
    """The decoded picture (first frame), as PIL opened it: format and pixels (the image's, and the
    request's running total in `budget`) checked from the header first."""
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{what}: {len(data)} bytes; the limit is {limits.max_bytes} bytes per image (--max-image-bytes)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))
        except Image.DecompressionBombError:  # PIL's own ceiling (2 * MAX_IMAGE_PIXELS), checked in open
            raise ImageError(
                f"{what}: more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels (a decompression bomb); the "
                f"limit is {limits.max_pixels} pixels (--max-image-pixels)"
            ) from None
        except Exception:
            raise ImageError(
                f"{what}: not an image in an allowed format (PNG, JPEG, WebP, GIF), or its header is corrupt"
            ) from None
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageError(
                f"{what}: {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels} pixels "
                "(--max-image-pixels)"
            )
        if width < 1 or height < 1:
            raise ImageError(f"{what}: an empty image ({width}x{height})")
        if budget is not None:
            budget.take_pixels(width, height, what)
        try:
            image.load()
        except Exception as e:
            raise ImageError(
                f"{what}: the {FORMATS[image.format or 'PNG']} image is corrupt or truncated ({e})"
            ) from None
    return image


def load_rgb(data: bytes, what: str, limits: ImageLimits, budget: RequestBudget | None = None) -> Image.Image:
    """Bytes to the RGB picture transformers' load_image gives for them (EXIF orientation applied); the
    pixels counted into the request's budget before they are decoded."""
    image = open_checked(data, what, limits, budget)
    try:
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Exception as e:  # a broken EXIF block, an unconvertible mode
        raise ImageError(f"{what}: cannot be converted to RGB ({e})") from None
