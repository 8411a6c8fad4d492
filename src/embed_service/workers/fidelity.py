"""The start-up fidelity check: the fast path against a float32 reference pass of the same weights.

Before a worker says it is ready it embeds a few fixed inputs twice: as it will serve them (the resolved
dtype, the kernels ops/fused.py chose, the attention backend, tensor parallelism), and with every parameter
cast to float32 and the kernels switched off (ops/fused.reference_only). The lowest cosine between the two
dense vectors of an input is the figure /info reports; below --fidelity-min-cosine the worker refuses to
become ready (or, with --fidelity-warn-only, says so and serves). A model that embeds images (CLIP,
SigLIP) also runs one synthetic picture, a fixed colour gradient preprocessed by the model's own image
processor, through both passes: its cosine counts in the minimum too. It is the guard against silently wrong
vectors: a kernel that zeroes odd features, a dtype that overflows, a shard mapped to the wrong rank.

The reference runs on the same device with the same sharding, so it checks numerics, not the sharding
itself (every rank holds only its shard). Casting the parameters back restores the very tensors the fast
path had: nothing is rounded twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from embed_service.ops import fused

# The fixed inputs: token ids drawn with a fixed seed, of these lengths (capped by the max input length).
# Short: on a CPU the float32 pass costs about 2 ms per token of the default model, at every start.
CHECK_LENGTHS = (3, 17, 90)
CHECK_SEED = 1234

# Real text beside the random ids where the fast path quantizes (--quantization int8, layers/quantize.py):
# per-token int8 fails on the outlier features real tokens raise and random ids do not (SmolLM2-135M in
# int8: 0.965 on a real query, benchmarks/results/int8_smollm2.json, though the random ids alone passed). Short ones first, as
# the worst cosines are the short texts'; the engine tokenizes them as it serves (WorkerConfig.check_ids).
CHECK_TEXTS = (
    "??",
    "ok",
    "Add a description here.",
    "Things I use all the time.",
    "How do I reverse a list in Python?",
    "1 2 3 4 5 6 7 8 9 10",
    "Ошибка при подключении к базе данных",
    "向量检索服务的嵌入模型",
    "¿Dónde está la estación de tren?",
    "SELECT name FROM users WHERE id = 42;",
    "def main():\n    return 0",
    "https://example.com/docs/api?v=2#section",
    "Returns the number of bytes written, or -1 on error.",
    "Raised when a configuration file cannot be parsed or names an unknown key.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A client library for the service's HTTP API: it retries failed requests with exponential backoff, "
    "streams large responses in chunks, and validates every reply against the published schema before "
    "handing it to the caller, raising a typed error that names the field at fault.",
)


@dataclass(frozen=True)
class FidelityResult:
    min_cosine: float | None  # None: not measured (see skipped)
    threshold: float
    inputs: int  # texts and images together
    skipped: str | None = None
    images: int = 0

    @property
    def passed(self) -> bool:
        return self.min_cosine is None or self.min_cosine >= self.threshold

    def info(self) -> dict[str, Any]:
        return {
            "min_cosine": self.min_cosine,
            "threshold": self.threshold,
            "inputs": self.inputs,
            "images": self.images,
            "passed": self.passed,
            "skipped": self.skipped,
        }


class FidelityError(RuntimeError):
    """The fast path's vectors are too far from the float32 reference: the worker does not become ready."""


def check_inputs(vocab_size: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(T,) int32 token ids and (B,) int32 lengths: ids away from the special tokens at the vocab's start."""
    lengths = np.array(sorted({min(n, max_len) for n in CHECK_LENGTHS}), dtype=np.int32)
    rng = np.random.default_rng(CHECK_SEED)
    low = min(1000, max(vocab_size // 4, 1))
    ids = rng.integers(low, max(vocab_size, low + 1), size=int(lengths.sum()), dtype=np.int64)
    return ids.astype(np.int32), lengths


def check_image(size: tuple[int, int]) -> Image.Image:
    """The synthetic picture: (height, width) = `size`, red rising left to right, green top to bottom,
    blue across the diagonal, so that every patch differs; deterministic, no file."""
    height, width = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rgb = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), (x + y) / max(width + height - 2, 1)], -1)
    return Image.fromarray((rgb * 255).round().astype(np.uint8), "RGB")


@contextlib.contextmanager
def float32_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Every parameter as a float32 copy inside the block; the original tensors back after it."""
    saved = [(p, p.data) for p in model.parameters() if p.dtype != torch.float32]
    try:
        for p, data in saved:
            p.data = data.float()
        yield
    finally:
        for p, data in saved:
            p.data = data


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    denom = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return (a * b).sum(axis=1) / denom


def measure(
    model: torch.nn.Module,
    run: Callable[[np.ndarray, np.ndarray], np.ndarray],
    vocab_size: int,
    max_len: int,
    threshold: float,
    fast_is_reference: bool,
    reference_run: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    image_run: Callable[[bool], np.ndarray] | None = None,
    text_ids: Sequence[Sequence[int]] = (),
) -> FidelityResult:
    """`run(ids, lengths)` -> (B, D) dense vectors from `model`, as served; `reference_run` the same
    eagerly, where `run` replays CUDA graphs (a replay would not follow the swapped parameters).
    `image_run(replay)` -> (1, D): the synthetic picture's vector (check_image), for a model that embeds
    images; replay False in the reference pass, as reference_run. `text_ids`: token ids of more inputs (the
    CHECK_TEXTS, tokenized), checked beside the random ones."""
    ids, lengths = check_inputs(vocab_size, max_len)
    seqs = [list(t)[:max_len] for t in text_ids if len(t)]
    if seqs:
        ids = np.concatenate([ids, np.array([i for t in seqs for i in t], dtype=np.int32)])
        lengths = np.concatenate([lengths, np.array([len(t) for t in seqs], dtype=np.int32)])
    images = int(image_run is not None)
    if threshold <= 0:
        return FidelityResult(None, threshold, 0, "--fidelity-min-cosine 0")
    if fast_is_reference:  # float32 and the references already: the fast path is the reference pass
        return FidelityResult(1.0, threshold, len(lengths) + images, None, images)
    fast = np.concatenate([run(ids, lengths), *([image_run(True)] if image_run else [])])
    try:
        with float32_parameters(model), fused.reference_only():
            texts = (reference_run or run)(ids, lengths)
            reference = np.concatenate([texts, *([image_run(False)] if image_run else [])])
    except torch.OutOfMemoryError:
        return FidelityResult(None, threshold, 0, "no memory for a float32 copy of the weights")
    worst = float(np.nan_to_num(cosines(fast, reference), nan=-1.0).min())
    return FidelityResult(round(worst, 6), threshold, len(fast), None, images)
