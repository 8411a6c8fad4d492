"""The attention backend a worker runs, and the arguments flash-attn's varlen kernel gets.

flash-attn needs CUDA (benchmarks/gpu_check.sh runs it against SDPA); here its documented semantics are
written out independently (window_size = (left, right) keys around the query, GQA over the key/value heads
as given) and fed the arguments the service builds, against the per-sequence reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from embed_service.ops import attention
from embed_service.ops.attention import backend_name, flash_varlen_kwargs, varlen_attention_reference
from embed_service.ops.batch import FlatBatch


@pytest.mark.parametrize(
    ("device", "dtype", "flash", "want"),
    [
        ("cuda", torch.bfloat16, True, "flash-attn"),
        ("cuda", torch.float16, True, "flash-attn"),
        ("cuda", torch.float32, True, "sdpa"),  # flash-attn has no float32 kernel
        ("cuda", torch.bfloat16, False, "sdpa"),  # not installed
    ],
)
def test_backend_on_cuda(device, dtype, flash, want):
    assert backend_name(device, dtype, flash_available=flash) == want


def test_backend_on_a_cpu_never_flash(monkeypatch):
    assert backend_name("cpu", torch.bfloat16, flash_available=True) in ("cpu-kernel", "sdpa")
    monkeypatch.setattr(attention, "attention_kernel", lambda: None)
    assert backend_name("cpu", torch.float32, flash_available=True) == "sdpa"


def fake_flash(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size
):
    """flash_attn_varlen_func as documented, one sequence at a time in float32."""
    assert k.shape[1] < q.shape[1] or k.shape[1] == q.shape[1]  # key/value heads as they are: no repeat
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
    left, right = window_size
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = torch.ones(n, n, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        qs = q[s:e].float().transpose(0, 1)
        ks = k[s:e].float().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[s:e].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2) * softmax_scale).masked_fill(~allowed, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_flash_arguments_give_the_reference(causal, window):
    lengths = [1, 7, 4]
    batch = FlatBatch.from_lengths(torch.zeros(sum(lengths), dtype=torch.long), lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, generator=g)
    k, v = torch.randn(sum(lengths), 2, 8, generator=g), torch.randn(sum(lengths), 2, 8, generator=g)  # GQA
    scale = 1 / math.sqrt(8)
    got = fake_flash(q, k, v, **flash_varlen_kwargs(batch, causal, scale, window))
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal, scale, window)
    torch.testing.assert_close(got, want)
