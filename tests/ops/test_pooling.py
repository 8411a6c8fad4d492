"""Pooling on the flat stream against a per-sequence loop."""

from __future__ import annotations

import torch

from embed_service.ops.pooling import POOLERS

LENGTHS = [3, 1, 7, 2]


def per_sequence(hidden: torch.Tensor, fn) -> torch.Tensor:
    out, start = [], 0
    for n in LENGTHS:
        out.append(fn(hidden[start : start + n]))
        start += n
    return torch.stack(out)


def test_poolers_match_a_loop():
    hidden = torch.randn(sum(LENGTHS), 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    cu = torch.tensor([0, 3, 4, 11, 13], dtype=torch.int32)
    h = hidden.float()
    expected = {
        "cls": per_sequence(h, lambda x: x[0]),
        "last": per_sequence(h, lambda x: x[-1]),
        "mean": per_sequence(h, lambda x: x.mean(0)),
        "mean_sqrt_len": per_sequence(h, lambda x: x.sum(0) / len(x) ** 0.5),
        "max": per_sequence(h, lambda x: x.max(0).values),
    }
    for name, want in expected.items():
        got = POOLERS[name](hidden, cu)
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
