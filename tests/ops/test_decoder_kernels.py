"""A decoder block's elementwise ops in bf16 on the CPU (csrc/decoder_ops.c): SwiGLU's silu(gate) * up,
rotary embeddings in place, RMSNorm with its residual add. Each against the torch reference the layers run
without it (transformers' own arithmetic in bf16), and each layer shown to take it in bf16 and to keep the
reference in float32 and in the fidelity check's reference pass."""

from __future__ import annotations

import pytest
import torch

from embed_service.layers.activation import act_and_mul, act_and_mul_reference
from embed_service.layers.norm import RMSNorm
from embed_service.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_reference
from embed_service.ops import decoder_kernels, fused


@pytest.fixture(scope="module")
def kernel() -> decoder_kernels.DecoderKernel:
    k = decoder_kernels.kernel()
    if k is None:
        pytest.skip("the compiled CPU kernels are unavailable here (no compiler and no prebuilt set)")
    return k


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors of the same sign pattern are, element by element."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_as_reference(got: torch.Tensor, want: torch.Tensor, most: int = 1) -> None:
    """The kernel rounds where the reference rounds; one float32 operation's order differs at most (the
    row's sum of squares, a fused multiply-add, the exponential's last bit): where the float32 value sits
    next to a bf16 rounding boundary the two fall one step apart, and only there (`most` steps where a
    rounded value is multiplied again before its own rounding)."""
    steps = steps_apart(got, want)
    assert int(steps.max()) <= most, int(steps.max())
    assert float((steps > 0).float().mean()) < 0.005


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,inter", [(1, 16), (7, 1536), (300, 64)])
def test_silu_mul_is_torchs(kernel, threads, rows, inter):
    x = (torch.randn(rows, 2 * inter, generator=gen()) * 4).bfloat16()
    # silu(gate) rounded to bf16 one step apart at most, then times up: two steps apart at most
    assert_as_reference(kernel.silu_mul(x), act_and_mul_reference(x, "silu"), most=2)


def test_silu_mul_at_the_exponentials_ends(kernel):
    """Gates far past where e^-x over- or underflows float32: silu(x) -> x for large x, -0 (or under 1e-36)
    for very negative x, as torch gives them; signed zeros, and a row stride wider than the row."""
    gate = torch.tensor(
        [0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 87.0, -87.0, 88.5, -88.5, 100.0, -100.0, 3e38, -3e38]
    )
    up = torch.linspace(-2, 2, gate.numel())
    wide = torch.cat([gate, up, torch.full_like(gate, 7.0)]).bfloat16()[None, :]
    x = wide[:, : 2 * gate.numel()]  # row stride 3n: the kernel reads through it
    got, want = kernel.silu_mul(x), act_and_mul_reference(x, "silu")
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-30)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("heads,dim", [(9, 64), (3, 64), (2, 128), (4, 8)])
def test_rotary_in_place_is_torchs(kernel, threads, heads, dim):
    tokens = 37
    rope = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0})
    cos, sin = rope(torch.arange(tokens) % 11)
    # q as the layers see it: a strided view of the merged projection, with other heads beside it
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen()).bfloat16()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    want = apply_rotary_reference(q, cos, sin)
    rest = qkv[:, heads * dim :].clone()
    got = kernel.rotary_(q, cos, sin)
    assert got.data_ptr() == q.data_ptr()  # in place
    assert_as_reference(got, want)
    assert torch.equal(qkv[:, heads * dim :], rest)  # nothing beside q written


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
@pytest.mark.parametrize("rows,n", [(1, 64), (33, 576), (5, 4096)])
def test_rms_norm_is_torchs(kernel, threads, with_residual, rows, n):
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=gen(1)).bfloat16()
    x = (torch.randn(rows, n, generator=gen(2)) * 3).bfloat16()
    residual = torch.randn(rows, n, generator=gen(3)).bfloat16() if with_residual else None
    out, summed = kernel.rms_norm(x, residual, norm.weight, norm.eps)
    want_sum = x if residual is None else x + residual
    assert torch.equal(summed, want_sum)  # one bf16 add, as torch's
    assert_as_reference(out, norm.reference(want_sum))


def test_the_layers_take_the_kernel_in_bf16_only(kernel):
    g = gen(4)
    x = torch.randn(12, 64, generator=g).bfloat16()
    assert torch.equal(act_and_mul(x, "silu"), kernel.silu_mul(x))
    assert torch.equal(act_and_mul(x, "swish"), kernel.silu_mul(x))
    # other activations and float32 keep the reference
    assert torch.equal(act_and_mul(x, "gelu"), act_and_mul_reference(x, "gelu"))
    assert torch.equal(act_and_mul(x.float(), "silu"), act_and_mul_reference(x.float(), "silu"))

    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=g).bfloat16()
    res = torch.randn(12, 64, generator=g).bfloat16()
    out, summed = norm(x, res)
    k_out, k_sum = kernel.rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(out, k_out) and torch.equal(summed, k_sum)
    norm32 = RMSNorm(64, 1e-6)
    norm32.weight.data = norm.weight.data.float()
    assert torch.equal(norm32(x.float()), norm32.reference(x.float()))

    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0})
    cos, sin = rope(torch.arange(12))
    q = torch.randn(12, 4, 16, generator=g).bfloat16()
    want = kernel.rotary_(q.clone(), cos, sin)
    assert torch.equal(apply_rotary(q.clone(), cos, sin), want)
    q32 = q.float()
    assert torch.equal(apply_rotary(q32, cos, sin), apply_rotary_reference(q32, cos, sin))


def test_the_reference_pass_keeps_torchs_ops(kernel):
    """The start-up fidelity check's reference pass (fused.reference_only) runs the references."""
    x = (torch.randn(9, 128, generator=gen(5)) * 4).bfloat16()
    with fused.reference_only():
        assert decoder_kernels.kernel() is None
        assert torch.equal(act_and_mul(x, "silu"), act_and_mul_reference(x, "silu"))
    assert decoder_kernels.kernel() is kernel
