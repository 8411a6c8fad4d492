"""Sliding-window attention on the flat token stream against a dense per-sequence softmax with an explicit mask."""

from __future__ import annotations

import math

import pytest
import torch

from embed_service.ops.attention import varlen_attention_reference
from embed_service.ops.batch import FlatBatch
from tests.ops.test_attention import BF16_PATHS, PATHS


def dense(q, k, v, lengths, causal, window):
    """Each sequence alone; the mask written out element by element."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].double().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        allowed = torch.tensor(
            [
                [(not causal or j <= i) and (window is None or abs(i - j) <= window) for j in range(n)]
                for i in range(n)
            ]
        )
        scores = (qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).float()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 0, 3, 8, 40])
@pytest.mark.parametrize("lengths", [[1], [13], [5, 1, 17, 9]])
@PATHS
def test_window_matches_dense(varlen_attention, causal, window, lengths):
    torch.manual_seed(sum(lengths))
    t = sum(lengths)
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)  # grouped-query heads
    batch = FlatBatch.from_lengths(torch.zeros(t, dtype=torch.long), lengths)
    expected = dense(q, k, v, lengths, causal, window)
    torch.testing.assert_close(
        varlen_attention(q, k, v, batch, causal, window=window), expected, atol=1e-5, rtol=1e-5
    )
    reference = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal, window=window)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)


@BF16_PATHS
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 0, 5, 20])
@pytest.mark.parametrize("d", [32, 64])
@PATHS
def test_window_bf16_head_sizes_of_the_pair_paths(varlen_attention, causal, window, d, bf16_path):
    """bf16 at head sizes 32/64 (AMX tiles or AVX512-BF16 dot products where present): windows cut inside
    16- and 8-query and 32-key blocks."""
    torch.manual_seed(d)
    lengths = [1, 40, 17, 33]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d).to(torch.bfloat16) for h in (4, 2, 2))
    batch = FlatBatch.from_lengths(torch.zeros(t, dtype=torch.long), lengths)
    expected = dense(q.float(), k.float(), v.float(), lengths, causal, window)
    got = varlen_attention(q, k, v, batch, causal, window=window).float()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
