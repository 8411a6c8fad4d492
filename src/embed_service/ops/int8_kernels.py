"""ctypes front of the two ends of an int8 linear layer in csrc/varlen_attention.c (`quantize_rows`,
`dequantize_rows`; layers/quantize.py), bound from the library ops/cpu_kernels loads."""

from __future__ import annotations

import ctypes

import torch

from embed_service.ops.cpu_kernels import AttentionKernel


class Int8Kernel:
    DTYPES = AttentionKernel.DTYPES

    def __init__(self, quantize, dequantize):
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        quantize.argtypes = [ptr, i32, i64, i32, ptr, ptr, ptr, i32]
        dequantize.argtypes = [ptr, i64, i32, ptr, ptr, ptr, ptr, ptr, i32, ptr, i32, i32]
        quantize.restype = dequantize.restype = i32
        self._quantize = quantize
        self._dequantize = dequantize

    @classmethod
    def of(cls, kernel: AttentionKernel | None) -> Int8Kernel | None:
        """The int8 ends of the loaded library, or None where it is absent or was built without them."""
        if kernel is None:
            return None
        quantize = getattr(kernel.lib, "quantize_rows", None)
        dequantize = getattr(kernel.lib, "dequantize_rows", None)
        return None if quantize is None or dequantize is None else cls(quantize, dequantize)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(M, K) bf16 or float32 contiguous -> ((M, K) int8, (M,) float32 scales, (M,) int32 zero points):
        per row asymmetric over [min(row, 0), max(row, 0)], row ~ scale * (q - zero)."""
        rows, k = x.shape
        q = torch.empty(rows, k, dtype=torch.int8)
        scale = torch.empty(rows, dtype=torch.float32)
        zero = torch.empty(rows, dtype=torch.int32)
        self._quantize(
            x.data_ptr(),
            self.DTYPES[x.dtype],
            rows,
            k,
            q.data_ptr(),
            scale.data_ptr(),
            zero.data_ptr(),
            torch.get_num_threads(),
        )
        return q, scale, zero

    def dequantize_rows(
        self,
        acc: torch.Tensor,
        row_scale: torch.Tensor,
        row_zero: torch.Tensor,
        col_scale: torch.Tensor,
        col_sum: torch.Tensor,
        bias: torch.Tensor | None,
        gelu: bool,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """(M, N) int32 -> (acc - row_zero[:, None] * col_sum) * row_scale[:, None] * col_scale + bias, exact
        GELU with `gelu`, in float32; `dtype` (bf16 or float32) out, bias in that dtype."""
        rows, n = acc.shape
        out = torch.empty(rows, n, dtype=dtype)
        rc = self._dequantize(
            acc.data_ptr(),
            rows,
            n,
            row_scale.data_ptr(),
            row_zero.data_ptr(),
            col_scale.data_ptr(),
            col_sum.data_ptr(),
            None if bias is None else bias.data_ptr(),
            int(gelu),
            out.data_ptr(),
            self.DTYPES[dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("dequantize_rows: no memory for its scratch space")
        return out
