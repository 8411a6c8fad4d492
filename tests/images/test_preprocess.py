"""The front end's preprocessing equals what AutoImageProcessor.from_pretrained(folder) gives a user, bit for
bit (tolerance 0), for CLIP's and SigLIP's processor settings over pictures of every size and mode.

In this environment AutoImageProcessor gives the PIL backend (CLIPImageProcessorPil, SiglipImageProcessorPil:
transformers 5 falls back to it when torchvision is not installed), and that is the reference asserted here;
the test checks it is the backend it compares with.

Encoded images go through transformers' own loading too: load_image of the base64 string (EXIF orientation,
RGB), then the processor, which is what sentence-transformers does with a path or a base64 string.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import transformers as T
from PIL import Image
from transformers.image_utils import load_image

from embed_service.images.decode import ImageLimits, load_rgb
from embed_service.images.preprocess import ImageProcessor
from tests.images.pictures import encode, gradient, pictures, shapes
from tests.models.test_clip import PREPROCESSOR as CLIP
from tests.models.test_siglip import PREPROCESSOR as SIGLIP

# Real checkpoints' settings beside the tiny models': openai/clip-vit-base-patch32's 224 crop, and a
# SigLIP at 384 with the processor's defaults (no file keys but the type).
CLIP_224 = {**CLIP, "size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}
SIGLIP_DEFAULTS = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384}}
CONFIGS = {"clip-32": CLIP, "clip-224": CLIP_224, "siglip-32-bilinear": SIGLIP, "siglip-384": SIGLIP_DEFAULTS}


def reference(tmp_path, config):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = T.AutoImageProcessor.from_pretrained(str(tmp_path))
    assert processor.backend == "pil", type(processor)
    return processor


@pytest.mark.parametrize("name", CONFIGS)
def test_pixels_equal_the_processor(tmp_path, name):
    processor = reference(tmp_path, CONFIGS[name])
    ours = ImageProcessor.from_folder(tmp_path)
    for picture in pictures():
        want = processor(images=picture.image, return_tensors="np")["pixel_values"][0]
        got = ours(picture.image)
        assert got.dtype == want.dtype == np.float32, picture.name
        assert got.shape == want.shape == (3, *ours.output_size), picture.name
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: {picture.name}")


def with_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif, quality=90)


def encoded() -> list[tuple[str, bytes]]:
    """Every picture as PNG (the modes PNG keeps: grey, alpha, palette with transparency, 16-bit), and the
    other formats: JPEG (RGB, grey, CMYK, EXIF orientations), WebP (lossless with alpha), GIF (two frames)."""
    out = []
    for p in pictures():
        if p.image.mode != "CMYK":
            out.append((f"png-{p.name}", encode(p.image, "PNG")))
    out.append(("jpeg-rgb", encode(shapes(120, 80), "JPEG", quality=85)))
    out.append(("jpeg-grey", encode(gradient(70, 30).convert("L"), "JPEG")))
    out.append(("jpeg-cmyk", encode(shapes(50, 64).convert("CMYK"), "JPEG")))
    for orientation in (3, 6, 8):
        out.append((f"jpeg-exif-orientation-{orientation}", with_orientation(shapes(90, 40), orientation)))
    rgba = shapes(60, 44).convert("RGBA")
    rgba.putalpha(gradient(60, 44).convert("L"))
    out.append(("webp-lossless-alpha", encode(rgba, "WEBP", lossless=True)))
    out.append(("webp-lossy", encode(shapes(64, 64), "WEBP", quality=70)))
    frames = [shapes(40, 30).convert("P"), gradient(40, 30).convert("P")]
    buf = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    out.append(("gif-two-frames", buf))
    return out


@pytest.mark.parametrize("name", ["clip-224", "siglip-32-bilinear"])
def test_encoded_images_equal_load_image_then_the_processor(tmp_path, name):
    processor = reference(tmp_path, CONFIGS[name])
    ours = ImageProcessor.from_folder(tmp_path)
    for label, data in encoded():
        want = processor(images=load_image(base64.b64encode(data).decode()), return_tensors="np")[
            "pixel_values"
        ][0]
        got = ours(load_rgb(data, label, ImageLimits()))
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: {label}")


def test_exif_orientation_is_applied():
    """Orientation 6 (rotate 90 degrees clockwise to display): a 90x40 picture comes out 40x90."""
    image = load_rgb(with_orientation(shapes(90, 40), 6), "image 0", ImageLimits())
    assert image.size == (40, 90)


def test_unsupported_processor_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Siglip2ImageProcessor"})
    )
    with pytest.raises(ValueError, match="Siglip2ImageProcessor.*not supported"):
        ImageProcessor.from_folder(tmp_path)
