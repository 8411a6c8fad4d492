"""What a two-tower (text and image) model's config.json says, read without torch: CLIP and SigLIP.

Each tower's settings are its ``text_config`` / ``vision_config`` over transformers' class defaults. The text
tower's settings are what the rest of the project reads as the model's (hidden size, vocabulary, positions,
heads: ModelSpec, the tokenizer, the tensor-parallel checks), so Family.standard_config lays them over the
top level. The vector size is the projections' (CLIP's ``projection_dim``; SigLIP's text ``projection_size``,
which equals the vision width). An image costs the batcher its tokens in the vision tower.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' CLIPTextConfig / CLIPVisionConfig / SiglipTextConfig / SiglipVisionConfig defaults, for keys
# a saved config leaves out.
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "CLIPModel": {
        "text_config": {
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_attention_heads": 8,
            "num_hidden_layers": 12,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "vocab_size": 49408,
            "eos_token_id": 49407,
            "pad_token_id": 1,
        },
        "vision_config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "image_size": 224,
            "patch_size": 32,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        },
    },
    "SiglipModel": {
        "text_config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "max_position_embeddings": 64,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "vocab_size": 32000,
            "pad_token_id": 1,
        },
        "vision_config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "image_size": 224,
            "patch_size": 16,
            "num_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "vision_use_head": True,
        },
    },
}


def tower(config: dict[str, Any], cls: str, key: str) -> dict[str, Any]:
    """One tower's settings: config.json's ``text_config`` or ``vision_config`` over the class defaults."""
    own = config.get(key) or {}
    if not isinstance(own, dict):
        raise ValueError(f"config.json: {key} is not an object")
    return {**DEFAULTS[cls][key], **{k: v for k, v in own.items() if v is not None}}


def dimension(config: dict[str, Any], cls: str) -> int:
    if cls == "CLIPModel":
        return int(config.get("projection_dim") or 512)
    text = tower(config, cls, "text_config")
    return int(text.get("projection_size") or text["hidden_size"])


def tokens_per_image(config: dict[str, Any], cls: str) -> int:
    """An image's sequence length in the vision tower: its patches, and CLIP's class token."""
    vision = tower(config, cls, "vision_config")
    patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    return patches + (1 if cls == "CLIPModel" else 0)


def image_size(config: dict[str, Any], cls: str) -> int:
    return int(tower(config, cls, "vision_config")["image_size"])


def siglip_padding(path: Path, config: dict[str, Any], cls: str) -> tuple[int, int] | None:
    """(length, pad id) every SigLIP text is padded to before its text tower, as SiglipProcessor and the
    documented usage pad it (``padding="max_length"``: the model pools the last position, trained so); the
    tokenizer's own pad token, else the text config's pad_token_id. None for CLIP (no padding)."""
    if cls != "SiglipModel":
        return None
    text = tower(config, cls, "text_config")
    return int(text["max_position_embeddings"]), tokenizer_pad_id(path, int(text["pad_token_id"]))


def tokenizer_pad_id(path: Path, default: int) -> int:
    """The id of tokenizer_config.json's pad_token in tokenizer.json (its added tokens, else its vocabulary)."""
    try:
        pad = json.loads((path / "tokenizer_config.json").read_text()).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        if not isinstance(pad, str):
            return default
        data = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return default
    for token in data.get("added_tokens") or []:
        if token.get("content") == pad:
            return int(token["id"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and pad in vocab:
        return int(vocab[pad])
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        for i, entry in enumerate(vocab):
            if entry and entry[0] == pad:
                return i
    return default
