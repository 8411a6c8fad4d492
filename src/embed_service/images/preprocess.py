"""The model's image processor (preprocessor_config.json) applied as transformers' PIL backend applies it.

CLIPImageProcessor and SiglipImageProcessor (and their ``Fast`` names: the same settings) in transformers 5
run, per image: the RGB conversion (``image_transforms.convert_to_rgb``: an image with an alpha band or a
``transparency`` entry is composited onto white, anything else ``convert("RGB")``), resize with PIL
(``shortest_edge``: the short side to that length, the long one ``int(size * long / short)``; or
``height``/``width``) with the configured resample filter, center crop (zero padding where the image is
smaller than the crop), rescale (in float64, then float32) and normalize ((x - mean) / std in float32).
Written here with the same PIL and numpy operations in the same order and dtypes, so the pixels are equal
bit for bit; torch-free, for the front ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# transformers' OPENAI_CLIP_MEAN / STD and IMAGENET_STANDARD_MEAN / STD
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN, STANDARD_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)

# Each processor class's defaults (image_processing_pil_clip.py, image_processing_pil_siglip.py).
PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
    },
    "SiglipImageProcessor": {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": False,
        "crop_size": None,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": STANDARD_MEAN,
        "image_std": STANDARD_STD,
        "do_convert_rgb": True,
    },
}
# Which defaults a model class's folder gets when preprocessor_config.json names no processor type.
ARCHITECTURE_PROCESSORS = {"CLIPModel": "CLIPImageProcessor", "SiglipModel": "SiglipImageProcessor"}


def _size(value: Any, what: str) -> tuple[str, tuple[int, int]]:
    """("shortest", (n, n)) or ("exact", (height, width)), as transformers' get_size_dict reads a size
    (an int is a shortest edge: both processors have default_to_square false)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return "shortest", (value, value)
    if isinstance(value, dict):
        if set(value) == {"shortest_edge"}:
            return "shortest", (int(value["shortest_edge"]),) * 2
        if set(value) == {"height", "width"}:
            return "exact", (int(value["height"]), int(value["width"]))
    raise ValueError(
        f"preprocessor_config.json: {what} {value!r} is not supported (shortest_edge, or height and width)"
    )


@dataclass(frozen=True)
class ImageProcessor:
    do_resize: bool
    size_mode: str
    size: tuple[int, int]
    resample: int
    do_center_crop: bool
    crop_size: tuple[int, int] | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_convert_rgb: bool
    processor_type: str

    @classmethod
    def from_dict(cls, config: dict[str, Any], architecture: str = "") -> ImageProcessor:
        kind = str(config.get("image_processor_type") or ARCHITECTURE_PROCESSORS.get(architecture, ""))
        kind = kind.removesuffix("Fast").removesuffix("Pil")
        if kind not in PROCESSOR_DEFAULTS:
            raise ValueError(
                f"preprocessor_config.json: image processor {kind or 'none'!r} is not supported; supported: "
                f"{', '.join(PROCESSOR_DEFAULTS)}"
            )
        c = {**PROCESSOR_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}
        mode, size = _size(c["size"], "size")
        crop = _size(c["crop_size"], "crop_size")[1] if c["do_center_crop"] else None
        mean, std = c["image_mean"], c["image_std"]
        mean = (float(mean),) * 3 if isinstance(mean, (int, float)) else tuple(float(m) for m in mean)
        std = (float(std),) * 3 if isinstance(std, (int, float)) else tuple(float(s) for s in std)
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("preprocessor_config.json: image_mean and image_std need 3 channels")
        return cls(
            do_resize=bool(c["do_resize"]),
            size_mode=mode,
            size=size,
            resample=int(c["resample"]),
            do_center_crop=bool(c["do_center_crop"]),
            crop_size=crop,
            do_rescale=bool(c["do_rescale"]),
            rescale_factor=float(c["rescale_factor"]),
            do_normalize=bool(c["do_normalize"]),
            image_mean=mean,
            image_std=std,
            do_convert_rgb=bool(c["do_convert_rgb"]),
            processor_type=kind,
        )

    @classmethod
    def from_folder(cls, path: str | Path, architecture: str = "") -> ImageProcessor:
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no preprocessor_config.json: its image processor is unknown")
        return cls.from_dict(json.loads(file.read_text()), architecture)

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every processed image: the crop, else the exact resize."""
        if self.crop_size is not None:
            return self.crop_size
        if self.do_resize and self.size_mode == "exact":
            return self.size
        raise ValueError(
            "preprocessor_config.json: neither a crop nor an exact size: images would vary in size"
        )

    def resize_to(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize (transformers' get_resize_output_image_size)."""
        if self.size_mode == "exact":
            return self.size
        target = self.size[0]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = target, int(target * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """A picture -> (3, H, W) float32 pixel values, as the processor gives them."""
        pixels = to_rgb(image) if self.do_convert_rgb else np.asarray(image)
        if self.do_resize:
            height, width = self.resize_to(*pixels.shape[:2])
            resized = Image.fromarray(pixels).resize((width, height), resample=self.resample)
            pixels = np.array(resized)
        if self.crop_size is not None:
            pixels = center_crop(pixels, self.crop_size)
        out = pixels.astype(np.float64) * self.rescale_factor if self.do_rescale else pixels
        out = out.astype(np.float32)
        if self.do_normalize:
            out = (out - np.array(self.image_mean, dtype=np.float32)) / np.array(
                self.image_std, dtype=np.float32
            )
        return np.ascontiguousarray(out.transpose(2, 0, 1))


def to_rgb(image: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8: transformers' convert_to_rgb of a PIL image (transparency composited onto white)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


def center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(H, W, C) -> (h, w, C) around the centre, zero padding where the image is smaller (transformers'
    image_transforms.center_crop)."""
    height, width = pixels.shape[:2]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    top_pad, left_pad = ceil((new_h - height) / 2), ceil((new_w - width) / 2)
    padded[top_pad : top_pad + height, left_pad : left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]
