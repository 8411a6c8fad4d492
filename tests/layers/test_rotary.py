"""Rotary frequencies and rotation against transformers' own rope initializers, in both config layouts."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from embed_service.layers.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies, rope_parameters

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
}


def reference(config) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return T.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim", [24, 64])
def test_frequencies_match_transformers(name, head_dim):
    kwargs = dict(hidden_size=128, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=1024)
    config = T.LlamaConfig(**kwargs, rope_theta=123456.0, rope_scaling=SCALINGS[name])
    expected, expected_scale = reference(config)
    # The layout transformers 5 writes (rope_parameters) ...
    ours, scale = inverse_frequencies(head_dim, rope_parameters(config.to_dict()))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    # ... and the older one (rope_theta and rope_scaling at the top level, "type" for "rope_type").
    old = {**kwargs, "rope_theta": 123456.0}
    if SCALINGS[name]:
        scaling = dict(SCALINGS[name])
        scaling["type"] = scaling.pop("rope_type")
        old["rope_scaling"] = scaling
    ours_old, scale_old = inverse_frequencies(head_dim, rope_parameters(old))
    torch.testing.assert_close(ours_old, expected, rtol=0, atol=0)
    assert scale_old == pytest.approx(expected_scale, rel=1e-12)


def test_theta_defaults_when_absent():
    assert rope_parameters({"max_position_embeddings": 8})["rope_theta"] == 10000.0


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ValueError, match="dynamic"):
        inverse_frequencies(64, rope_parameters({"rope_scaling": {"type": "dynamic", "factor": 2.0}}))


def test_rotation_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=5000.0)
    rope = RotaryEmbedding(16, rope_parameters(config.to_dict()))
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])  # two sequences, laid end to end
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cos, sin = rope(positions)
    ref_rope = T.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    ref_cos, ref_sin = ref_rope(q, positions[None])  # (1, T, D)
    # transformers rotates (B, H, T, D); ours is (T, H, D).
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0, atol=0)
