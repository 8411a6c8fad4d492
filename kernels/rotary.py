"""Rotary embedding in place on the flat token stream.

x (T, H, D) is rotated by cos/sin (T, 1, D) (or (T, D)): the per-token tables that
layers/rotary.RotaryEmbedding computes from each token's position within its own sequence, so positions
restart at every sequence of the batch (FlatBatch.positions, from cu_seqlens). The tables repeat their
first half (cat(freqs, freqs)); only that half is read. q and k may be views into the merged QKV
projection: any token and head strides, unit stride along D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    n_heads,
    stride_t,
    stride_h,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    c = tl.load(cos_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)
    mask = (heads[:, None] < n_heads) & dmask[None, :]
    base = x_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c[None, :] - x2 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) in place by cos/sin (T, 1, D) or (T, D); returns x."""
    n_tokens, n_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rotary_ needs a unit stride along the head dimension")
    cos2, sin2 = cos.reshape(n_tokens, -1), sin.reshape(n_tokens, -1)
    if cos2.stride(-1) != 1 or sin2.stride() != cos2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    half = head_dim // 2
    block_h = min(triton.next_power_of_2(n_heads), 16)
    if n_tokens:
        _rotary_kernel[(n_tokens, triton.cdiv(n_heads, block_h))](
            x,
            cos2,
            sin2,
            n_heads,
            x.stride(0),
            x.stride(1),
            cos2.stride(0),
            HALF=half,
            BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(half),
        )
    return x
