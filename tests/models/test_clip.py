"""CLIP's towers on the project's layers equal transformers' CLIPModel.get_text_features / get_image_features.

Tiny random CLIPModel folders (save_pretrained; weights at N(0, 0.08), norms and biases random), texts from
the corpora through a real tokenizer (SmolLM2's BPE wrapped in <|im_start|> ... <|im_end|>, <|im_end|> as
the end-of-text token), pixel values from the reference image processor on images drawn in the test. Min
cosine >= 0.99999 in float32, >= 0.999 in bfloat16 (against the float32 reference), one flat batch each, the
text batch padded the way a CPU worker pads it (ops/batch.py padded_tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T

from embed_service.models.loader import load_weights
from embed_service.ops.batch import FlatBatch, padded_tokens
from tests.images.pictures import pictures
from tests.models.tiny import load_tokenizer, randomize, texts

VISION = dict(
    hidden_size=48,
    intermediate_size=80,
    num_attention_heads=4,
    num_hidden_layers=2,
    image_size=32,
    patch_size=8,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_hidden_layers=2,
    max_position_embeddings=77,
)
PREPROCESSOR = {  # CLIP's own settings, at the tiny model's resolution
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 32},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 32, "width": 32},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def build_two_tower(
    path: Path,
    model_class: str,
    config: Any,
    tokenizer: Any,
    preprocessor: dict[str, Any],
) -> Path:
    """save_pretrained of a random model, its tokenizer and preprocessor_config.json."""
    torch.manual_seed(0)
    model = getattr(T, model_class)(config).eval()
    randomize(model)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return path


def ours(path: Path, dtype: torch.dtype, module: str, cls: str) -> Any:
    """The project's model on the folder's weights, built in `dtype` as the loader builds it."""
    import importlib

    config = json.loads((path / "config.json").read_text())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = getattr(importlib.import_module(f"embed_service.models.{module}"), cls)(
            SimpleNamespace(config=config)
        )
    finally:
        torch.set_default_dtype(prev)
    load_weights(model, path)
    return model.eval()


def text_vectors(model: Any, ids: list[list[int]]) -> np.ndarray:
    tokens = sum(len(s) for s in ids)
    batch = FlatBatch.from_lengths(torch.tensor([t for s in ids for t in s]), [len(s) for s in ids])
    with torch.inference_mode():
        return model.text_features(batch.padded(padded_tokens(tokens)), tokens).numpy()


def reference_text(path: Path, ids: list[list[int]], pad: int, mask: bool = True) -> np.ndarray:
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), 16):
            chunk = ids[start : start + 16]
            width = max(len(s) for s in chunk)
            input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            kw = {}
            if mask:
                kw["attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            out.append(model.get_text_features(input_ids=input_ids, **kw).pooler_output.numpy())
    return np.concatenate(out)


def reference_images(path: Path, pixels: torch.Tensor) -> np.ndarray:
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.get_image_features(pixel_values=pixels).pooler_output.numpy()


def pixel_values(path: Path) -> torch.Tensor:
    """The reference processor's pixels for the test pictures (every size and mode of tests/images)."""
    processor = T.AutoImageProcessor.from_pretrained(str(path))
    return processor(images=[p.image for p in pictures()], return_tensors="pt")["pixel_values"]


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def check_towers(path: Path, module: str, cls: str, ids: list[list[int]], ref_text: np.ndarray, label: str):
    pixels = pixel_values(path)
    ref_img = reference_images(path, pixels)
    for dtype, bound in ((torch.float32, 0.99999), (torch.bfloat16, 0.999)):
        model = ours(path, dtype, module, cls)
        got_text = text_vectors(model, ids)
        with torch.inference_mode():
            got_img = model.image_features(pixels.to(dtype)).numpy()
        assert got_text.shape == ref_text.shape and got_img.shape == ref_img.shape
        t, i = min_cos(got_text, ref_text), min_cos(got_img, ref_img)
        print(
            f"\n{label} {dtype}: text min cosine {t:.7f} ({len(ids)} texts), image {i:.7f} ({len(pixels)} images)"
        )
        assert t >= bound, f"{label} {dtype} text min cosine {t}"
        assert i >= bound, f"{label} {dtype} image min cosine {i}"


@pytest.mark.parametrize(
    "tokenizer, eos_token",
    [("wordpiece", "[SEP]"), ("bpe-template", None)],
    ids=["eos-token-id", "legacy-eos-2-highest-id"],
)
def test_clip_matches_transformers(tmp_path, tokenizer_sources, tokenizer, eos_token):
    """eos_token_id [SEP] (102): the first [SEP] is pooled. eos_token_id 2 (configs from before
    transformers#24773): the highest token id is pooled, wherever it stands."""
    tok = load_tokenizer(tokenizer, tokenizer_sources)
    eos = tok.convert_tokens_to_ids(eos_token) if eos_token else 2
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=eos, bos_token_id=1, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    path = build_two_tower(tmp_path / "clip", "CLIPModel", config, tok, PREPROCESSOR)
    ids = tok(texts(), truncation=True, max_length=TEXT["max_position_embeddings"])["input_ids"]
    # A text with no end-of-text token, and one with it mid-text: the pooled position is transformers' too.
    ids += [ids[0][:-1], (ids[1][:3] + [eos] + ids[1][3:])[: TEXT["max_position_embeddings"]]]
    # Padded with 0 in the reference batches: never the highest id, so the legacy rule sees the real ones.
    check_towers(path, "clip", "CLIPModel", ids, reference_text(path, ids, pad=0), f"CLIP {tokenizer}")
