"""Residual add + LayerNorm / RMSNorm in one pass over each row.

Semantics of the references (layers/norm.py): the residual sum is rounded to the activation dtype (it is
what the next block adds to), statistics are taken in float32; LayerNorm applies its affine in float32,
RMSNorm rounds the normalized row to the activation dtype before scaling by its weight, as transformers'
Llama does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)  # rounded as the reference's add in the activation dtype
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        mean = tl.sum(x, axis=0) / n_cols
        d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
        y = d * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (rows, H) with a unit column stride, without a copy where the layout allows."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _add_norm(x, residual, weight, bias, eps, rms):
    shape = x.shape
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    summed = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(n_cols)
    if n_rows:
        _add_norm_kernel[(n_rows,)](
            x2,
            res2,
            weight,
            bias if bias is not None else weight,
            out,
            summed,
            n_cols,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            summed.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None,
            RMS=rms,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    if residual is None:
        return out.view(shape), None
    return out.view(shape), summed.view(shape)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LayerNorm(x + residual) and x + residual (None without a residual). x, residual: (..., H)."""
    return _add_norm(x, residual, weight, bias, eps, rms=False)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x + residual) and x + residual (None without a residual). x, residual: (..., H)."""
    return _add_norm(x, residual, weight, None, eps, rms=True)
