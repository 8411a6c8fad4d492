"""Gated MLP activations on a merged [gate | up] projection: (T, 2I) -> (T, I), act(gate) * up.

The references (layers/activation.py) compute act(gate) in the activation dtype and round it before the
product; here both happen in float32 and round once, so results differ by at most one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = gate * tl.sigmoid(gate)
    elif ACT == 1:
        a = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        a = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh(u) = 2 sigmoid(2u) - 1
    tl.store(out_ptr + row * stride_out + cols, (a * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """(..., 2I) -> (..., I): activation(first half) * second half; activation in ACTIVATIONS."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no gated kernel for {activation!r}; have {sorted(ACTIVATIONS)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows, n_cols = x2.shape[0], shape[-1] // 2
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n_cols), 1024)
    if n_rows:
        _act_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            x2, out, n_cols, x2.stride(0), out.stride(0), ACT=ACTIVATIONS[activation], BLOCK=block
        )
    return out.view(*shape[:-1], n_cols)
