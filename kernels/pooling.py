"""Pooling over cu_seqlens fused with the Matryoshka slice and L2 normalization, float32 out.

One program per sequence: the sum (mean), the first row (CLS) or the last row (last token) of its span in
the flat stream, only the first ``dimensions`` features, then divided by max(norm, 1e-12) as
torch.nn.functional.normalize does. The references: ops/pooling.py, then a slice and F.normalize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = {"mean": 0, "cls": 1, "last": 2}


@triton.jit
def _pool_kernel(
    h_ptr,
    cu_ptr,
    out_ptr,
    dims,
    stride_h,
    stride_out,
    MODE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < dims
    if MODE == 0:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        rows = tl.arange(0, BLOCK_T)
        for t0 in range(start, end, BLOCK_T):
            r = t0 + rows
            tile = tl.load(
                h_ptr + r[:, None] * stride_h + cols[None, :],
                mask=(r[:, None] < end) & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(tile, axis=0)
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    else:
        row = start if MODE == 1 else end - 1
        acc = tl.load(h_ptr + row * stride_h + cols, mask=cmask, other=0.0).to(tl.float32)
    if NORMALIZE:
        norm = tl.sqrt(tl.sum(acc * acc, axis=0))
        acc = acc / tl.maximum(norm, 1e-12)
    tl.store(out_ptr + b * stride_out + cols, acc, mask=cmask)


def pool_normalize(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    dimensions: int | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """hidden (T, H), cu_seqlens (B + 1,) -> (B, dimensions or H) float32, pooled by `mode` (MODES)."""
    if mode not in MODES:
        raise ValueError(f"no pooling kernel for {mode!r}; have {sorted(MODES)}")
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    dims = hidden.shape[1] if dimensions is None else min(dimensions, hidden.shape[1])
    n_seqs = cu_seqlens.numel() - 1
    out = torch.empty(n_seqs, dims, dtype=torch.float32, device=hidden.device)
    block_d = triton.next_power_of_2(dims)
    if n_seqs:
        _pool_kernel[(n_seqs,)](
            hidden,
            cu_seqlens,
            out,
            dims,
            hidden.stride(0),
            out.stride(0),
            MODE=MODES[mode],
            NORMALIZE=normalize,
            BLOCK_T=max(1, min(16, 8192 // block_d)),
            BLOCK_D=block_d,
            num_warps=4 if block_d <= 2048 else 8,
        )
    return out
