"""bf16 linear layers on a CPU run on weights packed once in oneDNN's layout: the same products as the
plain weights give, and a weight written in place is packed again (never a stale copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_service.layers.activation import linear_act
from embed_service.layers.linear import ONEDNN_LINEAR, dense

pytestmark = pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch has no oneDNN linear kernel")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float(), b.float())


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_packed_matmul_matches_torch(tokens):
    torch.manual_seed(0)
    x = torch.randn(tokens, 384).bfloat16()
    w, b = torch.randn(1152, 384).bfloat16(), torch.randn(1152).bfloat16()
    for _ in range(2):  # the first call packs, the second uses the packed copy
        torch.testing.assert_close(dense(x, w, b).float(), reference(x, w, b), rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(
            linear_act(x, w, b, "gelu").float(), F.gelu(reference(x, w, b)), rtol=2e-2, atol=5e-2
        )


def test_a_weight_written_in_place_is_packed_again():
    torch.manual_seed(0)
    x = torch.randn(8, 384).bfloat16()
    w, b = torch.randn(384, 384).bfloat16(), torch.zeros(384).bfloat16()
    dense(x, w, b)
    linear_act(x, w, b, "gelu")
    w.copy_(torch.randn(384, 384).bfloat16())  # as a weight loader does
    torch.testing.assert_close(dense(x, w, b).float(), reference(x, w, b), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(
        linear_act(x, w, b, "gelu").float(), F.gelu(reference(x, w, b)), rtol=2e-2, atol=5e-2
    )


def test_a_weight_given_new_data_is_packed_again():
    torch.manual_seed(0)
    x = torch.randn(8, 384).bfloat16()
    w, b = (
        torch.nn.Parameter(torch.randn(384, 384).bfloat16(), requires_grad=False),
        torch.zeros(384).bfloat16(),
    )
    dense(x, w, b)
    w.data = torch.randn(384, 384).bfloat16()  # as the start-up fidelity check swaps parameters
    torch.testing.assert_close(dense(x, w, b).float(), reference(x, w, b), rtol=2e-2, atol=5e-2)


def test_packed_copies_stay_within_their_budget(monkeypatch):
    """A model whose weights would not fit twice keeps them plain past the budget: same products, no copy."""
    from embed_service.layers import linear

    torch.manual_seed(0)
    x = torch.randn(8, 384).bfloat16()
    small, big = torch.randn(384, 384).bfloat16(), torch.randn(1536, 384).bfloat16()
    before = linear.packed_bytes()
    monkeypatch.setattr(linear, "PACK_BUDGET_BYTES", before + small.nbytes + 1024)
    dense(x, small)
    assert linear.packed_bytes() > before  # packed within the budget
    held = linear.packed_bytes()
    torch.testing.assert_close(dense(x, big).float(), F.linear(x.float(), big.float()), rtol=2e-2, atol=5e-2)
    assert linear.packed_bytes() == held  # past it: the plain weight serves
    del small
    import gc

    gc.collect()
    assert linear.packed_bytes() == before  # a weight's copy goes with it
