"""Image rows, for ``embed-service encode --image-field`` (offline.py) and the Ray integration (ray.py).

A cell of an image column is one of the shapes image datasets are stored in:

- a path (a string): a relative one is resolved against a root (the job's ``--image-root``, by default the
  input file's folder), and the file is read when its row is embedded;
- encoded bytes (a Parquet binary column);
- a ``{"bytes": ..., "path": ...}`` struct, as Hugging Face datasets' ``Image`` feature stores it in Parquet:
  its bytes, or its path when they are null;
- in Ray batches also an (H, W[, C]) uint8 array, as ``ray.data.read_images`` gives: taken as
  ``PIL.Image.fromarray`` makes it.

Files and bytes are decoded and bounded by the engine as the server does (``--max-image-bytes``,
``--max-image-pixels``, the formats it allows); a refusal names the input, which the job turns into its row.
What is checked here is what only the job can tell: a cell that is no image at all, and a path with no file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from embed_service.offline_input import JobError, kind_of


class NotAnImage(ValueError):
    """A cell that holds no image, or names a file that is not there: the message says which."""


def image_source(value: Any, root: Path | None) -> Any:
    """A cell -> what `Embedder.encode` takes as an image (a `Path`, bytes or a PIL image)."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
        if value is None:
            raise NotAnImage("a struct whose bytes and path are both null")
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise NotAnImage("empty bytes")
        return bytes(value)
    if isinstance(value, str):
        if not value:
            raise NotAnImage("an empty path")
        path = Path(value).expanduser()
        if not path.is_absolute() and root is not None:
            path = root / path
        if not path.is_file():
            raise NotAnImage(f"{value!r}, and there is no file {path}")
        return path
    if isinstance(value, np.ndarray):
        return _from_array(value)
    if value is None:
        raise NotAnImage("missing")
    if type(value).__module__.startswith("PIL."):
        return value
    raise NotAnImage(f"{kind_of(value)}, not an image path or bytes")


def _from_array(value: np.ndarray) -> Any:
    from PIL import Image

    if value.dtype == object:  # a column of lists, as pandas or pyarrow may hand a tensor
        value = np.asarray(value.tolist())
    if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] > 4):
        raise NotAnImage(
            f"a {value.dtype} array of shape {value.shape}, not (H, W) or (H, W, C) uint8 pixels"
        )
    return Image.fromarray(
        np.ascontiguousarray(value[..., 0] if value.ndim == 3 and value.shape[2] == 1 else value)
    )


def row_key(value: Any) -> Any:
    """What the job's hash of its rows records of a cell (offline_input.py): a path as given, bytes by
    their SHA-256."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    if isinstance(value, dict):
        return {k: row_key(v) for k, v in sorted(value.items())}
    return value


class ImageColumn:
    """The job's image column: `sources` checks a block's cells, naming the row of one that is no image."""

    def __init__(self, path: Path, field: str, root: Path):
        self.path, self.field, self.root = path, field, root

    def sources(self, values: list[Any], where: Any) -> list[Any]:
        out = []
        for i, value in enumerate(values):
            try:
                out.append(image_source(value, self.root))
            except NotAnImage as exc:
                raise JobError(f"{self.path}: {where(i)}: the {self.field!r} field is {exc}") from None
        return out

    def keys(self, values: list[Any]) -> list[Any]:
        return [row_key(v) for v in values]


def check_image_job(args: Any, fmt: str) -> None:
    """Refuse what an image job cannot do, before anything starts."""
    if args.text_field is not None:
        raise JobError(
            "--text-field and --image-field name two columns; a job embeds one: run one job for each"
        )
    if fmt == "text":
        raise JobError("--image-field applies to JSON lines, CSV and Parquet inputs, which have fields")
    for flag, value in (("--prompt", args.prompt), ("--prompt-name", args.prompt_name)):
        if value is not None:
            raise JobError(f"{flag} applies to texts; an --image-field job embeds images only")


def check_model(info: dict[str, Any]) -> None:
    """A text-only model refuses an image job once it is up, before any row is read."""
    if "image" not in info.get("modalities", ()):
        raise JobError(
            f"--image-field: model {info.get('model')} embeds text only; images need a CLIP or SigLIP "
            "model with its preprocessor_config.json (docs/models.md)"
        )
