"""Every refusal of an image input: what is sent, and the error that names the input and the limit."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np
import pytest

from embed_service.images.decode import (
    ImageError,
    ImageLimits,
    RequestBudget,
    decode_base64,
    load_rgb,
    open_checked,
)
from tests.images.pictures import encode, from_array, gradient, noise, shapes

LIMITS = ImageLimits()


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header says width x height: a decompression bomb's header, with none of its data."""
    data = bytearray(encode(gradient(1, 1), "PNG"))
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr) & 0xFFFFFFFF)
    return bytes(data)


def test_decompression_bomb_is_refused_from_its_header():
    """A 10000 x 10000 header on a file of a few dozen bytes: refused on the pixel count, not as truncated
    (so the check came before any pixel was decoded)."""
    bomb = png_claiming(10000, 10000)
    assert len(bomb) < 100
    with pytest.raises(
        ImageError,
        match=r"image 3: 10000x10000 = 100000000 pixels; the limit is 16777216 pixels \(--max-image-pixels\)",
    ):
        open_checked(bomb, "image 3", LIMITS)


def test_bomb_beyond_pils_own_ceiling_is_refused_with_the_limit():
    """Past twice PIL's MAX_IMAGE_PIXELS, PIL itself refuses in Image.open; the message still names ours."""
    with pytest.raises(
        ImageError,
        match=r"image 3: more than 178956970 pixels \(a decompression bomb\); the limit is 16777216 pixels \(--max-image-pixels\)",
    ):
        open_checked(png_claiming(20000, 20000), "image 3", LIMITS)


def test_pixel_limit_is_the_configured_one():
    data = encode(gradient(40, 40), "PNG")
    with pytest.raises(ImageError, match=r"input\[1\]: 40x40 = 1600 pixels; the limit is 1000 pixels"):
        load_rgb(data, "input[1]", ImageLimits(max_pixels=1000))
    assert load_rgb(data, "input[1]", ImageLimits(max_pixels=1600)).size == (40, 40)


def test_too_many_bytes_per_image_is_refused():
    data = encode(from_array(noise(64, 64, 3, 0), "RGB"), "PNG")
    assert len(data) > 10_000
    with pytest.raises(
        ImageError,
        match=rf"image 0: {len(data)} bytes; the limit is 10000 bytes per image \(--max-image-bytes\)",
    ):
        load_rgb(data, "image 0", ImageLimits(max_bytes=10_000))


def test_too_many_bytes_in_base64_are_refused_before_decoding():
    text = "data:image/png;base64," + "A" * 40_000
    with pytest.raises(
        ImageError, match=r"input\[0\]: about 30000 bytes; the limit is 10000 bytes per image"
    ):
        decode_base64(text, "input[0]", ImageLimits(max_bytes=10_000))


def test_too_many_bytes_per_request_are_refused():
    budget = RequestBudget(ImageLimits(max_bytes=10_000, max_request_bytes=25_000))
    budget.take(9_000, "input[0]")
    budget.take(9_000, "input[1]")
    with pytest.raises(
        ImageError,
        match=r"input\[2\]: the request's images reach 27000 bytes; the limit is 25000 bytes per request \(--max-request-image-bytes\)",
    ):
        budget.take(9_000, "input[2]")


def test_too_many_decoded_pixels_per_request_are_refused_from_the_headers():
    """Small files holding large pictures: the request's pixel total is checked from each header, so the
    image past the budget is refused before its pixels are decoded (its file holds none)."""
    limits = ImageLimits(max_pixels=1000 * 1000, max_request_pixels=2_500_000)
    budget = RequestBudget(limits)
    picture = load_rgb(encode(gradient(1000, 1000), "PNG"), "input[0]", limits, budget)
    assert picture.size == (1000, 1000)
    load_rgb(encode(gradient(1000, 1000), "PNG"), "input[1]", limits, budget)
    with pytest.raises(
        ImageError,
        match=r"input\[2\]: the request's images reach 3000000 pixels; the limit is 2500000 pixels per "
        r"request \(--max-request-image-pixels\)",
    ):
        load_rgb(png_claiming(1000, 1000), "input[2]", limits, budget)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "PPM", "ICO"])
def test_other_formats_are_refused(fmt):
    """Formats PIL reads but the server does not take."""
    data = encode(shapes(32, 32), fmt)
    with pytest.raises(
        ImageError, match=r"image 0: not an image in an allowed format \(PNG, JPEG, WebP, GIF\)"
    ):
        load_rgb(data, "image 0", LIMITS)


def test_bytes_that_are_no_image_are_refused():
    with pytest.raises(ImageError, match="image 0: not an image in an allowed format"):
        load_rgb(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image 0", LIMITS)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_truncated_images_are_refused(fmt):
    data = encode(from_array(noise(96, 96, 3, 5), "RGB"), fmt)
    with pytest.raises(
        ImageError,
        match=r"image 2: (the \w+ image is corrupt or truncated|not an image in an allowed format)",
    ):
        load_rgb(data[: len(data) // 2], "image 2", LIMITS)


def test_corrupt_png_data_is_refused():
    """The compressed pixel data overwritten: the CRC check or the inflate fails."""
    data = bytearray(encode(from_array(noise(64, 64, 3, 6), "RGB"), "PNG"))
    start = data.index(b"IDAT") + 20
    data[start : start + 200] = bytes(np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8))
    with pytest.raises(ImageError, match="image 0: the PNG image is corrupt or truncated"):
        load_rgb(bytes(data), "image 0", LIMITS)


def test_remote_urls_are_refused():
    with pytest.raises(
        ImageError,
        match=r"input\[4\]: remote image URLs are not fetched by default; .*--allowed-media-domains",
    ):
        decode_base64("https://example.com/cat.png", "input[4]", LIMITS)


def test_bad_base64_and_media_types_are_refused():
    with pytest.raises(ImageError, match="input\\[0\\]: not valid base64"):
        decode_base64("data:image/png;base64,@@@@", "input[0]", LIMITS)
    with pytest.raises(ImageError, match="input\\[0\\]: media type 'image/svg\\+xml'; allowed"):
        decode_base64("data:image/svg+xml;base64,AAAA", "input[0]", LIMITS)
    with pytest.raises(ImageError, match="must be base64 encoded"):
        decode_base64("data:image/png,rawbytes", "input[0]", LIMITS)


def test_data_urls_and_bare_base64_decode():
    data = encode(shapes(20, 10), "PNG")
    b64 = base64.b64encode(data).decode()
    assert decode_base64("data:image/png;base64," + b64, "x", LIMITS) == data
    assert decode_base64(b64, "x", LIMITS) == data  # Jina's {"image": "<base64>"}
