"""The varlen attention fast path against its per-sequence reference twin, over odd sizes."""

from __future__ import annotations

import pytest
import torch

from embed_service.ops.attention import varlen_attention, varlen_attention_reference
from embed_service.ops.batch import FlatBatch


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
def test_matches_reference_fp32(lengths, causal, heads):
    q, k, v, batch = make(lengths, heads[0], heads[1], 24, torch.float32)
    got = varlen_attention(q, k, v, batch, causal=causal)
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=causal)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_matches_reference_bf16():
    q, k, v, batch = make([9, 40, 2], 8, 2, 32, torch.bfloat16)
    got = varlen_attention(q, k, v, batch, causal=False).float()
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal=False).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_sequences_do_not_see_each_other():
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
