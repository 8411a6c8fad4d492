"""Normalization layers. Statistics are taken in float32 whatever the activation dtype.

Both take an optional residual: ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``, the
add and the norm in one pass over the row where the Triton kernel runs (ops/fused.py chooses), or for
RMSNorm in bf16 on a CPU the C kernel (ops/decoder_kernels.py); the plain add then the norm elsewhere. The
bodies here are the kernels' references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers.linear import default_weight_loader
from embed_service.ops import decoder_kernels, fused


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(..., H) -> (..., H); with a residual, (normed, x + residual)."""
        if (k := fused.kernels()) is not None:
            out, summed = k.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
            return out if residual is None else (out, summed)
        if residual is None:
            return self.reference(x)
        x = x + residual
        return self.reference(x), x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or (x.device.type == "cpu" and x.dtype == self.weight.dtype):
            # The CPU kernel accumulates bfloat16/float16 in float32 already: no casts, no copies.
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(..., H) -> (..., H); with a residual, (normed, x + residual)."""
        if (k := fused.kernels()) is not None:
            out, summed = k.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, summed)
        if (c := decoder_kernels.kernel()) and self._on_cpu_kernel(c, x, residual):
            out, summed = c.rms_norm(x, residual, self.weight, self.eps)  # one pass (ops/csrc/decoder_ops.c)
            return out if residual is None else (out, summed)
        if residual is None:
            return self.reference(x)
        x = x + residual
        return self.reference(x), x

    def _on_cpu_kernel(
        self, c: decoder_kernels.DecoderKernel, x: torch.Tensor, residual: torch.Tensor | None
    ) -> bool:
        """bf16 on a CPU, every operand contiguous."""
        operands = (x, self.weight) if residual is None else (x, residual, self.weight)
        return (
            c.takes(*operands)
            and all(t.is_contiguous() for t in operands)
            and (residual is None or residual.shape == x.shape)
        )

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers does: normalize in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores the scale less one (``x * (1 + weight)``), and the scaling is
    done in float32 before the cast back, as transformers' Gemma 2 / 3 do (Llama scales after the cast)."""

    # No fused residual form: the Gemma blocks add their residuals themselves (models/gemma.py).
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
