"""Rotary position embeddings with the config's theta and scaling.

Frequencies follow transformers' rope initializers (``default``, ``linear``, ``llama3``, ``yarn``), computed
in float32 the same way, so float32 results match the reference bit for bit. Rotation is applied to the
flat token stream using each token's position within its own sequence. Nothing here is sharded: every rank
rotates its own heads with the same tables.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from embed_service.ops import decoder_kernels, fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """One flat dict of rope settings from either config layout.

    Older configs carry ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5 writes
    ``rope_parameters``. As in transformers, ``rope_scaling`` wins over ``rope_parameters`` and the theta
    comes from the parameters, else the top level, else the architecture's default.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        )
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(head_dim / 2,) float32 inverse frequencies and the cos/sin scaling factor."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    base = float(params["rope_theta"])
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, params)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp  # 1 where the dimension keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, 1, D); in float32 whatever the activation dtype.

    With the Triton kernel (ops/fused.py), or the C kernel in bf16 on a CPU (ops/decoder_kernels.py), x is
    rotated in place and returned; callers use the result.
    """
    if (k := fused.kernels()) is not None and x.stride(-1) == 1:
        return k.rotary_(x, cos, sin)
    if (
        x.dim() == 3
        and cos.dtype == sin.dtype == torch.float32
        and (c := decoder_kernels.kernel())
        and c.takes(x)
    ):
        return c.rotary_(x, cos, sin)  # bf16 on a CPU: in place, one pass (ops/csrc/decoder_ops.c)
    return apply_rotary_reference(x, cos, sin)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's twin: a new tensor, x unchanged."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's position, computed once per batch and shared by every layer."""

    inv_freq: torch.Tensor  # (D / 2,) float32, a buffer

    def __init__(self, head_dim: int, params: dict[str, Any]):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(head_dim, params)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, D) float32, as the reference computes them."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling)[:, None, :], (emb.sin() * self.attention_scaling)[
            :, None, :
        ]
