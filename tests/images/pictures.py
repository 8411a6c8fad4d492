"""Pictures drawn in the tests: gradients, noise, shapes, in several sizes and every mode a user may send."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw


@dataclass(frozen=True)
class Picture:
    name: str
    image: Image.Image


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width)[None, :]
    y = np.linspace(0, 255, height)[:, None]
    rgb = np.stack(
        [np.broadcast_to(x, (height, width)), np.broadcast_to(y, (height, width)), (x + y) / 2 % 256], -1
    )
    return from_array(rgb.astype(np.uint8), "RGB")


def noise(width: int, height: int, channels: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def shapes(width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), (30, 60, 90))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width * 0.1, height * 0.2, width * 0.7, height * 0.9), fill=(250, 200, 10))
    draw.rectangle((width * 0.5, height * 0.05, width * 0.95, height * 0.5), fill=(10, 220, 120))
    draw.line((0, height - 1, width - 1, 0), fill=(255, 0, 255), width=max(1, width // 20))
    return image


def from_array(pixels: np.ndarray, mode: str) -> Image.Image:
    """An image of `mode` from (H, W[, C]) raw values (Image.fromarray no longer takes a mode)."""
    return Image.frombytes(mode, (pixels.shape[1], pixels.shape[0]), np.ascontiguousarray(pixels).tobytes())


def pictures() -> list[Picture]:
    """Sizes above, below and at the tiny models' 32-pixel resolution, tall and wide, and the modes: RGB, L,
    LA, RGBA (varying alpha), P (with and without a transparent index), CMYK, I;16, 1."""
    rgba = np.concatenate(
        [noise(40, 30, 3, 1), np.linspace(0, 255, 40 * 30).reshape(30, 40, 1).astype(np.uint8)], -1
    )
    palette = gradient(45, 45).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    transparent = palette.copy()
    transparent.info["transparency"] = 3
    sixteen = (np.linspace(0, 65535, 33 * 47).reshape(47, 33)).astype(np.uint16)
    return [
        Picture("gradient-64x48", gradient(64, 48)),
        Picture("gradient-tall-20x90", gradient(20, 90)),
        Picture("gradient-32x32", gradient(32, 32)),
        Picture("small-7x5", gradient(7, 5)),  # smaller than the crop: zero padding
        Picture("noise-rgb-257x129", from_array(noise(257, 129, 3, 0), "RGB")),
        Picture("shapes-300x200", shapes(300, 200)),
        Picture("shapes-odd-33x61", shapes(33, 61)),
        Picture("grey-L-50x50", from_array(noise(50, 50, 1, 2)[..., 0], "L")),
        Picture("grey-alpha-LA", from_array(noise(36, 36, 2, 3), "LA")),
        Picture("rgba-40x30", from_array(rgba, "RGBA")),
        Picture("palette-P", palette),
        Picture("palette-transparent-P", transparent),
        Picture("cmyk-CMYK", from_array(noise(48, 40, 4, 4), "CMYK")),
        Picture("sixteen-bit-I;16", Image.fromarray(sixteen)),
        Picture("bilevel-1", shapes(40, 40).convert("1")),
    ]


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()
