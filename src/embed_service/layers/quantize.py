"""Opt-in int8 linear layers (``--quantization int8``): int8 weights per output channel, int8 activations per
token, computed as each batch arrives; the integer products summed exactly in int32.

What is quantized: the transformer body's attention output and MLP projections (the Column- and
RowParallelLinear layers, layers/linear.mark_int8). The query/key/value projections stay in the model's dtype: measured
layer by layer they cost the most fidelity (docs/performance.md, "int8 quantization"), as do the
embeddings, norms, attention, pooling and the heads. The bfloat16 (or float32) weights stay beside their
int8 copies: the start-up fidelity check compares the served vectors with a float32 pass of those weights
(workers/fidelity.py) and refuses to serve below ``INT8_MIN_COSINE``.

How: x[t, :] ~ s_x[t] * (x_q[t, :] - z_x[t]), per token and asymmetric over [min(x[t], 0), max(x[t], 0)] in
256 steps; w[n, :] ~ s_w[n] * w_q[n, :], per output feature and symmetric (max |w[n, :]| / 127); then
y = (x_q @ w_q^T - z_x[:, None] * sum_k w_q[:, k]) * s_x[:, None] * s_w + b, the zero point's share taken
off exactly in int32. Asymmetric activations because a token's features are not centred on zero (GELU's
output is >= -0.17; LayerNorm's has a bias), so a symmetric grid would leave part of its steps unused.
The matmul is torch._int_mm (oneDNN's int8 kernels: VNNI, AMX-INT8 where the CPU has it; a CPU without
VNNI is refused, `unsupported`: its int8 kernels pair products in saturating 16-bit sums); the project's
compiled kernel quantizes the rows and applies scales, bias and GELU in one pass each (ops/csrc,
`quantize_rows` / `dequantize_rows`), torch where it is absent. Integer sums do not depend on the
blocking, and the scales are per row and per column, so a token's result does not depend on its batch:
--batch-invariant holds unchanged. Decoder families are refused too (`unsupported`): measured on
SmolLM2-135M, their activations' outlier features take per-token int8 far below the floor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embed_service.ops import fused
from embed_service.ops.cpu_kernels import attention_kernel
from embed_service.ops.int8_kernels import Int8Kernel

INT8_MIN_COSINE = 0.995
"""The fidelity floor of --quantization int8: the start-up check's threshold unless --fidelity-min-cosine
says otherwise (the unquantized default is 0.999)."""


VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def unsupported(device: str, causal: bool, cpu_flags: set[str]) -> str | None:
    """Why --quantization int8 cannot serve this model here, or None."""
    if device != "cpu":
        return f"--quantization int8 runs on CPUs only (device: {device})"
    if causal:
        return (
            "--quantization int8 serves encoder models only: a decoder's activations carry outlier features "
            "that per-token int8 rounds away (SmolLM2-135M: cosine 0.965 to float32 on a real query, "
            "docs/performance.md#int8-quantization)"
        )
    if not any(flag in cpu_flags for flag in VNNI_FLAGS):
        return (
            "--quantization int8 needs a CPU with VNNI (avx512_vnni, avx_vnni) or AMX-INT8: without them "
            "oneDNN's int8 kernels sum pairs of products in saturating 16-bit integers"
        )
    return None


def fidelity_threshold(settings) -> float:
    """The start-up check's threshold for a model's settings (config.ModelSettings): --fidelity-min-cosine
    where given, else INT8_MIN_COSINE with --quantization int8 and 0.999 without."""
    if settings.fidelity_min_cosine is not None:
        return float(settings.fidelity_min_cosine)
    return INT8_MIN_COSINE if settings.quantization == "int8" else 0.999


@dataclass(eq=False)
class Int8Weight:
    """A (N, K) weight as (N, K) int8 values, (N,) float32 scales and (N,) int32 sums of each row's values."""

    values: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes + self.sums.nbytes


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """Per output channel, symmetric: scale = max |w[n, :]| / 127 (1 for a row of zeros)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(values, scale, values.sum(dim=1, dtype=torch.int32))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this matmul runs in int8: a marked weight, on a CPU, (tokens, features) in the weight's dtype
    (bf16 or float32), outside the fidelity check's reference pass."""
    return (
        getattr(weight, "int8", False)
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float32)
        and not fused.suspended()
    )


@functools.cache
def _kernel() -> Int8Kernel | None:
    return Int8Kernel.of(attention_kernel())


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """x @ W^T + bias (then exact GELU with `gelu`) in int8: x (M, K) bf16 or float32, out in x's dtype."""
    kernel = _kernel()
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    if kernel is None:
        return linear_reference(x, weight, bias, gelu)
    q, row_scale, row_zero = kernel.quantize_rows(x)
    acc = torch._int_mm(q, weight.values.t())
    return kernel.dequantize_rows(acc, row_scale, row_zero, weight.scale, weight.sums, bias, gelu, x.dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of the kernel's `quantize_rows`: (int8 values, float32 scales, int32 zero points)."""
    xf = x.float()
    lo = xf.amin(dim=1).clamp(max=0)
    hi = xf.amax(dim=1).clamp(min=0)
    scale = (hi - lo) / 255
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    zero = torch.round(-lo * inv).clamp(0, 255)
    u = (torch.round(xf * inv[:, None]) + zero[:, None]).clamp(0, 255)
    return (u - 128).to(torch.int8), scale, (zero - 128).to(torch.int32)


def linear_reference(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, gelu: bool
) -> torch.Tensor:
    """The same arithmetic in torch ops (where the compiled kernel is absent, and the tests' reference)."""
    q, row_scale, row_zero = quantize_rows_reference(x)
    acc = torch._int_mm(q, weight.values.t()) - row_zero[:, None] * weight.sums
    out = acc.float() * row_scale[:, None] * weight.scale
    if bias is not None:
        out = out + bias.float()
    if gelu:
        out = F.gelu(out)
    return out.to(x.dtype)
