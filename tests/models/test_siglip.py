"""SigLIP's towers on the project's layers equal transformers' SiglipModel.get_text_features /
get_image_features (see test_clip.py for the setup). Texts come in as the tokenizer gives them, unpadded;
the reference is what the SigLIP docs and SiglipProcessor do, padding="max_length" (the last position, a
pad token, is pooled), so the server pads them the same, with the tokenizer's pad token (not the config's
pad_token_id, set apart here). Images through the attention-pooling head; a bilinear resample filter.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers as T

from embed_service.models.spec import load_spec
from tests.models.test_clip import (
    TEXT,
    VISION,
    build_two_tower,
    check_towers,
    min_cos,
    pixel_values,
    reference_images,
    tensor_parallel_vectors,
)
from tests.models.tiny import load_tokenizer, texts

PREPROCESSOR = {  # SigLIP's own settings at the tiny model's resolution, with another resample filter
    "image_processor_type": "SiglipImageProcessor",
    "do_resize": True,
    "size": {"height": 32, "width": 32},
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
MAX_LENGTH = 64


def siglip_folder(tmp_path, tokenizer_sources):
    tok = load_tokenizer("bpe-template", tokenizer_sources)
    tok.pad_token = "<|endoftext|>"  # id 0; the config says 5
    text = dict(
        TEXT,
        vocab_size=len(tok),
        max_position_embeddings=MAX_LENGTH,
        projection_size=VISION["hidden_size"],
        pad_token_id=5,
        hidden_act="gelu_pytorch_tanh",
    )
    vision = dict(VISION, hidden_act="gelu_pytorch_tanh")
    config = T.SiglipConfig(text_config=text, vision_config=vision)
    return build_two_tower(tmp_path / "siglip", "SiglipModel", config, tok, PREPROCESSOR), tok


def reference(path, ids: list[list[int]]) -> np.ndarray:
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.get_text_features(input_ids=torch.tensor(ids)).pooler_output.numpy()


def test_siglip_matches_transformers(tmp_path, tokenizer_sources):
    path, tok = siglip_folder(tmp_path, tokenizer_sources)
    assert load_spec(path).text_padding == (MAX_LENGTH, 0)
    padded = tok(texts(), padding="max_length", truncation=True, max_length=MAX_LENGTH)["input_ids"]
    unpadded = tok(texts(), truncation=True, max_length=MAX_LENGTH)["input_ids"]
    check_towers(path, unpadded, reference(path, padded), "SigLIP")


def test_siglip_tensor_parallel_2_equals_transformers(tmp_path, tokenizer_sources):
    """Both towers and the attention-pooling head split over 2 ranks give transformers' vectors."""
    path, tok = siglip_folder(tmp_path, tokenizer_sources)
    padded = tok(texts()[:24], padding="max_length", truncation=True, max_length=MAX_LENGTH)["input_ids"]
    unpadded = tok(texts()[:24], truncation=True, max_length=MAX_LENGTH)["input_ids"]
    pixels = pixel_values(path)
    got_text, got_img = tensor_parallel_vectors(path, unpadded, pixels)
    assert min_cos(got_text, reference(path, padded)) >= 0.99999
    assert min_cos(got_img, reference_images(path, pixels)) >= 0.99999
