"""Both CPU varlen attention paths (the compiled kernel and the torch fallback) against the per-sequence
reference twin, over odd sizes, head sizes, dtypes and strided views."""

from __future__ import annotations

import shutil

import pytest
import torch

from embed_service.ops import attention as attention_mod
from embed_service.ops import cpu_kernels
from embed_service.ops.attention import varlen_attention_reference, varlen_attention_torch
from embed_service.ops.batch import FlatBatch
from embed_service.ops.cpu_kernels import attention_kernel


def _kernel_path(q, k, v, batch, causal, scale=None, window=None):
    kernel = attention_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel is unavailable here (no C compiler); the torch path is tested")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    assert kernel.supports(q, k, v)
    return kernel(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, scale, window)


def _torch_path(q, k, v, batch, causal, scale=None, window=None):
    return varlen_attention_torch(q, k, v, batch, causal, scale or q.shape[-1] ** -0.5, window)


PATHS = pytest.mark.parametrize("varlen_attention", [_kernel_path, _torch_path], ids=["kernel", "torch"])

# The kernel's bf16 paths, forced by environment: the fastest this CPU has (AMX tiles, else AVX512-BF16 dot
# products, else float32 FMAs), the dot products where the CPU has them (AMX off), and the float32 FMAs.
BF16_PATHS = pytest.mark.parametrize(  # the `bf16_path` fixture (conftest.py) sets them
    "bf16_path",
    [{}, {"EMBED_CPU_AMX": "0"}, {"EMBED_CPU_AMX": "0", "EMBED_CPU_BF16_DOT": "0"}],
    ids=["fastest", "no-amx", "float32-fma"],
    indirect=True,
)


def test_kernel_is_built_where_a_compiler_exists():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the server runs on torch's kernels")
    assert attention_kernel() is not None


def test_dispatch_uses_the_kernel_on_cpu(monkeypatch):
    calls = []
    kernel = attention_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel is unavailable here (no C compiler)")
    monkeypatch.setattr(attention_mod, "attention_kernel", lambda: _Spy(kernel, calls))
    q, k, v, batch = make([3, 5], 2, 2, 16, torch.float32)
    attention_mod.varlen_attention(q, k, v, batch, causal=False)
    assert calls == [1]


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def supports(self, *a):
        return self.kernel.supports(*a)

    def __call__(self, *a):
        self.calls.append(1)
        return self.kernel(*a)


def make(lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    batch = FlatBatch.from_lengths(torch.zeros(t, dtype=torch.long), lengths)
    return q, k, v, batch


@pytest.mark.parametrize(
    "lengths", [[1], [7], [1, 1, 1], [5, 17, 1, 33], [64, 3, 129], [40, 40, 40], [100, 5, 99, 4, 98, 5, 70]]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
@PATHS
def test_matches_reference_fp32(varlen_attention, lengths, causal, heads):
    q, k, v, batch = make(lengths, heads[0], heads[1], 24, torch.float32)
    got = varlen_attention(q, k, v, batch, causal=causal)
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=causal)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@BF16_PATHS
@pytest.mark.parametrize("d", [32, 64, 128, 80])
@PATHS
def test_matches_reference_bf16(varlen_attention, d, bf16_path):
    """Head sizes 32 and 64 run on AMX tiles where the CPU has them, multiples of 32 on the AVX512-BF16 dot
    products where it has those; EMBED_CPU_AMX=0 and EMBED_CPU_BF16_DOT=0 force the float32 path."""
    q, k, v, batch = make([9, 40, 2, 300], 8, 2, d, torch.bfloat16)
    got = varlen_attention(q, k, v, batch, causal=False).float()
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=False).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@BF16_PATHS
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64])
def test_bf16_kernel_is_about_as_accurate_as_torchs_bf16(d, causal, bf16_path):
    """Against float64, the kernel's mean error is within 1.5x of torch's own bf16 attention's (the kernel
    rounds the softmax weights to bf16 for the second product, which the reference does not: ~1.25x here).
    The elementwise check above allows 2e-2; this one sees a softmax whose exponential is off by ~1% (1.8x)."""
    q, k, v, batch = make([9, 40, 2, 300], 8, 2, d, torch.bfloat16)
    q = q * 2  # scores spread over several units, as a trained model's are
    exact = varlen_attention_reference(q.double(), k.double(), v.double(), batch.cu_seqlens, causal=causal)
    torchs = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=causal).double()
    got = _kernel_path(q, k, v, batch, causal).double()
    ours, theirs = float((got - exact).abs().mean()), float((torchs - exact).abs().mean())
    assert ours <= 1.5 * theirs, (ours, theirs)


@BF16_PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@PATHS
def test_strided_views_of_a_packed_projection(varlen_attention, dtype, causal, bf16_path):
    """What the models pass: q, k, v as views into one (T, (Hq + 2 Hkv) * D) projection."""
    lengths = [17, 1, 64, 33]
    t, hq, hkv, d = sum(lengths), 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(1)).to(dtype)
    q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    batch = FlatBatch.from_lengths(torch.zeros(t, dtype=torch.long), lengths)
    got = varlen_attention(q, k, v, batch, causal=causal).float()
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=causal).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@PATHS
def test_sequences_do_not_see_each_other(varlen_attention):
    q, k, v, batch = make([10, 12], 2, 2, 8, torch.float32)
    alone = varlen_attention(
        q[:10], k[:10], v[:10], FlatBatch.from_lengths(torch.zeros(10), [10]), causal=False
    )
    together = varlen_attention(q, k, v, batch, causal=False)
    torch.testing.assert_close(together[:10], alone, atol=1e-6, rtol=1e-5)


def test_positions_restart_per_sequence():
    b = FlatBatch.from_lengths(torch.arange(6), [2, 3, 1])
    assert b.positions.tolist() == [0, 1, 0, 1, 2, 0]
    assert b.cu_seqlens.tolist() == [0, 2, 5, 6] and b.max_seqlen == 3


def cpu_has(flag: str) -> bool:
    return flag in cpu_kernels.cpu_flags()


@pytest.mark.parametrize("d", [32, 64, 96, 128, 80, 24])
def test_the_path_each_head_size_takes(d, monkeypatch):
    """bf16 takes the fastest path the CPU has for its head size, float32 always the FMAs; the switches turn
    the bf16 paths off one by one."""
    kernel = attention_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel is unavailable here (no C compiler)")
    amx = cpu_has("amx_bf16") and cpu_has("amx_tile") and d in (32, 64)
    dot = cpu_has("avx512_bf16") and d % 32 == 0
    assert kernel.path(torch.float32, d) == "float32"
    assert kernel.path(torch.bfloat16, d) == ("amx" if amx else "avx512-bf16" if dot else "float32")
    monkeypatch.setenv("EMBED_CPU_AMX", "0")
    assert kernel.path(torch.bfloat16, d) == ("avx512-bf16" if dot else "float32")
    monkeypatch.setenv("EMBED_CPU_BF16_DOT", "0")
    assert kernel.path(torch.bfloat16, d) == "float32"
