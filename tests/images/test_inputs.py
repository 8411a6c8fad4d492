"""Input items of every accepted shape are told apart, and each image source gives the processor's pixels."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import transformers as T
from transformers.image_utils import load_image

from embed_service.images.decode import ImageError, ImageLimits
from embed_service.images.inputs import IMAGE, TEXT, ImagePreparer, ImageStats, InputItemError, classify
from embed_service.images.preprocess import ImageProcessor
from tests.images.pictures import encode, shapes
from tests.models.test_clip import PREPROCESSOR

URL = "data:image/png;base64,AAAA"


@pytest.mark.parametrize(
    "item, kind, value",
    [
        ("a photo", TEXT, "a photo"),
        ({"type": "text", "text": "a photo"}, TEXT, "a photo"),
        ({"type": "image_url", "image_url": {"url": URL}}, IMAGE, URL),
        ({"type": "image_url", "image_url": URL}, IMAGE, URL),
        ({"text": "a photo"}, TEXT, "a photo"),
        ({"image": URL}, IMAGE, URL),
    ],
)
def test_item_shapes(item, kind, value):
    assert classify(item, "input[0]") == (kind, value)


@pytest.mark.parametrize(
    "item", [{"type": "video_url"}, {"image": 3}, {"type": "image_url"}, 7, {"text": "a", "image": URL}]
)
def test_unknown_item_shapes_are_refused(item):
    with pytest.raises(InputItemError, match=r"input\[2\]"):
        classify(item, "input[2]")


def test_every_source_gives_the_processors_pixels(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    processor = T.AutoImageProcessor.from_pretrained(str(tmp_path))
    prep = ImagePreparer(ImageProcessor.from_folder(tmp_path), 17, ImageLimits())
    picture = shapes(70, 50).convert("RGBA")
    data = encode(picture, "PNG")
    (tmp_path / "p.png").write_bytes(data)
    from_file = processor(images=load_image(str(tmp_path / "p.png")), return_tensors="np")["pixel_values"][0]
    from_pil = processor(images=picture, return_tensors="np")["pixel_values"][0]
    stats, budget = ImageStats(), prep.request()
    sources = {
        "data url": "data:image/png;base64," + base64.b64encode(data).decode(),
        "bytes": data,
        "path": tmp_path / "p.png",
    }
    for name, source in sources.items():
        got = np.frombuffer(prep.pixels(source, name, budget, stats), np.float32).reshape(from_file.shape)
        np.testing.assert_array_equal(got, from_file, err_msg=name)
    got = np.frombuffer(prep.pixels(picture, "pil", budget, stats), np.float32).reshape(from_pil.shape)
    np.testing.assert_array_equal(got, from_pil)
    assert (stats.images, stats.bytes) == (4, 3 * len(data))
    assert prep.placeholder() == [0] * 17


def test_pil_image_over_the_pixel_limit_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    prep = ImagePreparer(ImageProcessor.from_folder(tmp_path), 17, ImageLimits(max_pixels=100))
    with pytest.raises(ImageError, match=r"image 0: 20x10 = 200 pixels; the limit is 100 pixels"):
        prep.pixels(shapes(20, 10), "image 0", prep.request())
