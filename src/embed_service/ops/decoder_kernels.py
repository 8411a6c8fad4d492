"""ctypes front of a decoder block's elementwise ops in bf16 on the CPU (csrc/decoder_ops.c): SwiGLU's
silu(gate) * up, rotary embeddings in place (ModernBERT's rotary too: the same layer), RMSNorm with its
residual add; bound from the library ops/cpu_kernels loads. `kernel()` is None where that library is absent
(EMBED_CPU_KERNELS=0, no compiler and no prebuilt one) or during the fidelity check's reference pass: the
layers then run their torch references.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from embed_service.ops import fused
from embed_service.ops.cpu_kernels import AttentionKernel, attention_kernel


class DecoderKernel:
    def __init__(self, lib: ctypes.CDLL):
        i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._silu_mul = lib.silu_mul_rows
        self._silu_mul.argtypes = [ptr, i64, i64, i64, ptr, i32]
        self._rotary = lib.rotary_rows
        self._rotary.argtypes = [ptr, i64, i32, i32, i64, i64, ptr, ptr, i32]
        self._rms_norm = lib.rms_norm_rows
        self._rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, ptr, i32]
        for fn in (self._silu_mul, self._rotary, self._rms_norm):
            fn.restype = None

    @classmethod
    def of(cls, kernel: AttentionKernel | None) -> DecoderKernel | None:
        if kernel is None or getattr(kernel.lib, "rms_norm_rows", None) is None:
            return None
        return cls(kernel.lib)

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """bf16 on the CPU, the last dimension contiguous."""
        return all(
            t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in tensors
        )

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, 2n) -> (T, n): silu(x[:, :n]) * x[:, n:]."""
        rows, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, n, dtype=x.dtype)
        self._silu_mul(x.data_ptr(), rows, n, x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, H, D) rotated in place by cos, sin (T, 1, D) float32; returns x."""
        t, h, d = x.shape
        cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
        self._rotary(
            x.data_ptr(),
            t,
            h,
            d,
            x.stride(0),
            x.stride(1),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
        return x

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual); x and residual (..., n) contiguous."""
        n = x.shape[-1]
        rows = x.numel() // n
        out = torch.empty_like(x)
        summed = x if residual is None else torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            eps,
            rows,
            n,
            out.data_ptr(),
            summed.data_ptr(),
            torch.get_num_threads(),
        )
        return out, summed


@functools.cache
def _loaded() -> DecoderKernel | None:
    return DecoderKernel.of(attention_kernel())


def kernel() -> DecoderKernel | None:
    """The kernels, unless absent or the fidelity check's reference pass is running (fused.suspended)."""
    return None if fused.suspended() else _loaded()
