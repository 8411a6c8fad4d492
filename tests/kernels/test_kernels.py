"""Each Triton kernel against its plain-PyTorch reference (the layers' own code), over odd sizes.

Sizes: hidden 769 (not a power of two: the masked tail of every block), sequences of length 1, a batch of
one, inputs that are views with a row stride wider than the row (as q/k are in the merged QKV projection),
and transposed inputs (copied first). Tolerances: float32 within 1e-5 (different summation order);
bfloat16 within one bfloat16 rounding of the reference (rtol 1.6e-2, atol 1e-2 on values of order 1),
since the kernels round once where the references round after each step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_service.layers.activation import GATED_KERNELS, act_and_mul, act_and_mul_reference
from embed_service.layers.norm import LayerNorm, RMSNorm
from embed_service.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_reference
from embed_service.ops import fused
from embed_service.ops.batch import FlatBatch
from embed_service.ops.pooling import pool

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}}
# The residual sum: exact in float32; in bfloat16 within one rounding (Triton's interpreter rounds float32
# to bfloat16 toward zero where torch and the GPU round to nearest even).
SUM_TOL = {torch.float32: {"atol": 0, "rtol": 0}, torch.bfloat16: {"atol": 0, "rtol": 2**-7}}
HIDDEN = 769


def randn(*shape: int, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as x (rows, H), laid out as `how` says."""
    if how == "contiguous":
        return x
    if how == "row-strided":  # a view into a wider tensor: row stride > H
        wide = torch.zeros(x.shape[0], x.shape[1] + 31, dtype=x.dtype, device=x.device)
        wide[:, 3 : 3 + x.shape[1]] = x
        return wide[:, 3 : 3 + x.shape[1]]
    return x.t().contiguous().t()  # transposed: column stride > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("how", ["contiguous", "row-strided", "transposed"])
@pytest.mark.parametrize("residual", [False, True])
def test_add_layer_norm(K, device, dtype, rows, how, residual):
    norm = LayerNorm(HIDDEN, 1e-5).to(device)
    norm.weight.data = randn(HIDDEN, seed=1, device=device).to(dtype)
    norm.bias.data = randn(HIDDEN, seed=2, device=device).to(dtype)
    x = layout(randn(rows, HIDDEN, dtype=dtype, device=device, seed=3), how)
    r = randn(rows, HIDDEN, dtype=dtype, device=device, seed=4) if residual else None
    out, summed = K.add_layer_norm(x, r, norm.weight, norm.bias, norm.eps)
    want_sum = x + r if residual else x
    torch.testing.assert_close(out, norm.reference(want_sum), **TOL[dtype])
    if residual:
        torch.testing.assert_close(summed, want_sum, **SUM_TOL[dtype])
    else:
        assert summed is None


def test_layer_norm_without_bias(K, device):
    norm = LayerNorm(HIDDEN, 1e-5, bias=False).to(device)
    norm.weight.data = randn(HIDDEN, seed=1, device=device)
    x = randn(3, HIDDEN, device=device)
    torch.testing.assert_close(K.add_layer_norm(x, None, norm.weight, None, norm.eps)[0], norm.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("how", ["contiguous", "row-strided"])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm(K, device, dtype, rows, how, residual):
    norm = RMSNorm(HIDDEN, 1e-6).to(device)
    norm.weight.data = randn(HIDDEN, seed=1, device=device).to(dtype)
    x = layout(randn(rows, HIDDEN, dtype=dtype, device=device, seed=3), how)
    r = randn(rows, HIDDEN, dtype=dtype, device=device, seed=4) if residual else None
    out, summed = K.add_rms_norm(x, r, norm.weight, norm.eps)
    want_sum = x + r if residual else x
    torch.testing.assert_close(out, norm.reference(want_sum), **TOL[dtype])
    if residual:
        torch.testing.assert_close(summed, want_sum, **SUM_TOL[dtype])


def test_norm_layers_take_the_kernel_when_chosen(kernels_on, device):
    """The layer's own forward, with the kernel chosen, gives the reference's (normed, sum) pair."""
    norm = RMSNorm(HIDDEN, 1e-6).to(device)
    norm.weight.data = randn(HIDDEN, seed=1, device=device)
    x, r = randn(4, HIDDEN, device=device, seed=2), randn(4, HIDDEN, device=device, seed=3)
    out, summed = norm(x, r)
    torch.testing.assert_close(out, norm.reference(x + r), **TOL[torch.float32])
    torch.testing.assert_close(summed, x + r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[1], [1, 5, 2, 1]])
@pytest.mark.parametrize("head_dim", [10, 64])
def test_rotary_in_place_on_the_flat_stream(K, device, dtype, lengths, head_dim):
    """q and k as views into a merged QKV projection; positions restart at every sequence."""
    heads, kv_heads = 3, 1
    batch = FlatBatch.from_lengths(torch.zeros(sum(lengths), dtype=torch.long), lengths).to(device)
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 1000.0}).to(device)
    cos, sin = rope(batch.positions)
    T = sum(lengths)
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, seed=5)
    q, k, _ = qkv.view(T, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    want_q, want_k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got_q, got_k = K.rotary_(q, cos, sin), K.rotary_(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before, atol=0, rtol=0)


def test_apply_rotary_takes_the_kernel_when_chosen(kernels_on, device):
    batch = FlatBatch.from_lengths(torch.zeros(6, dtype=torch.long), [2, 4]).to(device)
    cos, sin = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}).to(device)(
        batch.positions
    )
    x = randn(6, 2, 16, device=device)
    want = apply_rotary_reference(x, cos, sin)
    torch.testing.assert_close(apply_rotary(x, cos, sin), want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(GATED_KERNELS))
@pytest.mark.parametrize("how", ["contiguous", "row-strided"])
def test_act_and_mul(K, device, dtype, name, how):
    x = layout(randn(3, 2 * HIDDEN, dtype=dtype, device=device, seed=6) * 2, how)
    # In float32 on the same values: the bfloat16 reference rounds every step of the tanh polynomial and
    # lands further from the true value than the kernel, which rounds once.
    want = act_and_mul_reference(x.float(), name).to(dtype)
    torch.testing.assert_close(K.act_and_mul(x, GATED_KERNELS[name]), want, **TOL[dtype])


def test_act_and_mul_one_row_through_the_layer(kernels_on, device):
    x = randn(1, 2 * HIDDEN, device=device, seed=7)
    torch.testing.assert_close(act_and_mul(x, "silu"), act_and_mul_reference(x, "silu"), **TOL[torch.float32])
    # An activation without a gated kernel runs its reference.
    torch.testing.assert_close(act_and_mul(x, "relu"), act_and_mul_reference(x, "relu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
@pytest.mark.parametrize("lengths", [[1], [1, 4, 1, 9]])
@pytest.mark.parametrize(
    ("dimensions", "normalize"), [(None, False), (None, True), (256, True), (100, False)]
)
def test_pool_normalize(K, device, dtype, mode, lengths, dimensions, normalize):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    hidden = layout(randn(sum(lengths), HIDDEN, dtype=dtype, device=device, seed=8), "row-strided")
    with fused.reference_only():
        want = pool(hidden, cu, mode, dimensions, normalize)
    got = K.pool_normalize(hidden, cu, mode, dimensions, normalize)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # float32 out from float32 sums: the tolerance is float32's whatever the input dtype.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if normalize:
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(lengths), device=device))


def test_pool_takes_the_kernel_when_chosen(kernels_on, device):
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    hidden = randn(3, HIDDEN, device=device)
    want = F.normalize(hidden[[0, 2]], dim=-1)[:, :64]
    torch.testing.assert_close(pool(hidden, cu, "last", None, True)[:, :64], want)
    torch.testing.assert_close(pool(hidden, cu, "max"), torch.stack([hidden[0], hidden[1:].max(0).values]))
