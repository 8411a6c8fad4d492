"""The attention backend a worker runs, and the arguments the CUDA varlen kernels get.

torch's varlen_attn and flash-attn's varlen kernel need CUDA (benchmarks/gpu_check.sh runs them against
each other and SDPA); here their documented semantics are written out independently (window_size = (left,
right) keys around the query, (-1, 0) causal for torch's; GQA over the key/value heads as given) and fed
the arguments the service builds, against the per-sequence reference. Which torch signature is usable is
read from the signature itself: 2.10's (is_causal, no window), 2.11's (window_size), 2.13's (enable_gqa).
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from embed_service.ops import attention
from embed_service.ops.attention import backend_name, flash_varlen_kwargs, varlen_attention_reference
from embed_service.ops.batch import FlatBatch


@pytest.mark.parametrize(
    ("dtype", "native", "flash", "wanted", "want"),
    [
        (torch.bfloat16, True, True, "auto", "torch-varlen"),  # torch's own first
        (torch.float16, True, False, "auto", "torch-varlen"),
        (torch.bfloat16, False, True, "auto", "flash-attn"),  # a torch without a usable varlen_attn
        (torch.bfloat16, True, True, "flash-attn", "flash-attn"),  # EMBED_ATTENTION=flash-attn
        (torch.bfloat16, True, False, "flash-attn", "torch-varlen"),  # wanted but not installed
        (torch.bfloat16, True, True, "sdpa", "sdpa"),
        (torch.float32, True, True, "auto", "sdpa"),  # neither kernel has float32
        (torch.bfloat16, False, False, "auto", "sdpa"),
    ],
)
def test_backend_on_cuda(dtype, native, flash, wanted, want):
    got = backend_name("cuda", dtype, flash_available=flash, torch_varlen_available=native, wanted=wanted)
    assert got == want


def test_backend_on_a_cpu_never_a_cuda_kernel(monkeypatch):
    for wanted in ("auto", "torch-varlen", "flash-attn"):
        got = backend_name("cpu", torch.bfloat16, True, True, wanted)
        assert got in ("cpu-kernel", "sdpa")
    monkeypatch.setattr(attention, "attention_kernel", lambda: None)
    assert backend_name("cpu", torch.float32, flash_available=True, torch_varlen_available=True) == "sdpa"


def test_embed_attention_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("EMBED_ATTENTION", "SDPA")
    assert backend_name("cuda", torch.bfloat16, True, True) == "sdpa"
    monkeypatch.setenv("EMBED_ATTENTION", "xformers")
    with pytest.raises(ValueError, match="EMBED_ATTENTION='xformers'"):
        backend_name("cuda", torch.bfloat16, True, True)


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


# torch.nn.attention.varlen.varlen_attn's signatures as released (the body never runs: only the signature is
# read), and the one this machine's torch has.
def varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    raise AssertionError


def varlen_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):  # fmt: skip
    raise AssertionError


def test_torch_varlen_is_detected_by_its_signature():
    assert attention.torch_varlen(SimpleNamespace()) is None  # no varlen_attn (torch < 2.10)
    assert attention.torch_varlen(SimpleNamespace(varlen_attn=varlen_210)) is None  # no window: not used
    fn, params = attention.torch_varlen(SimpleNamespace(varlen_attn=varlen_211))
    assert fn is varlen_211 and "window_size" in params and "enable_gqa" not in params
    installed = pytest.importorskip("torch.nn.attention.varlen", reason="torch < 2.10 has no varlen_attn")
    found = attention.torch_varlen(installed)
    if "window_size" in inspect.signature(installed.varlen_attn).parameters:
        assert found is not None and found[0] is installed.varlen_attn
    else:
        assert found is None


def documented_varlen(params):
    """varlen_attn as torch documents it, one sequence at a time in float32; with or without enable_gqa."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                    window_size=(-1, -1), **rest):  # fmt: skip
        assert set(rest) <= params - {"scale", "window_size"}, rest
        if "enable_gqa" in params:
            assert rest["enable_gqa"] == (query.shape[1] != key.shape[1])
        assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        assert type(max_q) is int and max_q == max_k == int(cu_seq_q.diff().max())
        assert isinstance(window_size, tuple)  # compared with (-1, 0) by the function itself
        return fake_flash(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
            causal=window_size == (-1, 0), window_size=window_size,
        )  # fmt: skip

    return varlen_attn


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("gqa_flag", [False, True], ids=["2.11", "2.13"])
def test_torch_varlen_arguments_give_the_reference(causal, window, gqa_flag):
    lengths = [1, 7, 4]
    batch = FlatBatch.from_lengths(torch.zeros(sum(lengths), dtype=torch.long), lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, generator=g)
    k, v = torch.randn(sum(lengths), 2, 8, generator=g), torch.randn(sum(lengths), 2, 8, generator=g)  # GQA
    scale = 1 / math.sqrt(8)
    params = frozenset(inspect.signature(varlen_211).parameters) | ({"enable_gqa"} if gqa_flag else set())
    args, kwargs = attention.torch_varlen_args(q, k, batch, causal, scale, window, params)
    got = documented_varlen(params)(q, k, v, *args, **kwargs)
    want = varlen_attention_reference(q, k, v, batch.cu_seqlens, causal, scale, window)
    torch.testing.assert_close(got, want)
