"""The project's linear for short sequences (layers.linear.small_linear, csrc `small_linear`): on the AMX tiles
(1 to 16 rows) or as AVX512-BF16 dot products (1 to 4,096 rows, 256 past two threads), what the layers
return against a float32 matmul of the same bf16 values, and where it steps aside for oneDNN (more rows,
batch invariance, shapes it does not take). Each path the CPU has is tested: the fastest (the tiles where
present), and the dot products with the tiles off (EMBED_CPU_AMX=0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_service.layers import linear
from embed_service.layers.activation import linear_act
from embed_service.ops import cpu_kernels, invariance

FLAGS = cpu_kernels.cpu_flags()
PATH_ENV = {"fastest": {}, "dot": {"EMBED_CPU_AMX": "0"}}
# The dot products with the tiles off are a path of their own only where the CPU has both; elsewhere
# "fastest" is the one path there is.
PATHS = list(PATH_ENV) if "avx512_bf16" in FLAGS and {"amx_bf16", "amx_tile"} <= FLAGS else ["fastest"]


@pytest.fixture(params=PATHS, autouse=True)
def path(request, monkeypatch):
    """Each test on each path: the kernel's choice is made once per process, so it is made again here."""
    for name, value in PATH_ENV[request.param].items():
        monkeypatch.setenv(name, value)
    linear._small_kernel.cache_clear()
    if linear._small_kernel()[0] is None:
        pytest.skip(
            "the project's linear runs only on a CPU with AMX tiles or AVX512-BF16 where its kernel loads; "
            "this one has neither, so the layers keep oneDNN at every row count"
        )
    yield request.param
    linear._small_kernel.cache_clear()


SHAPES = [(1152, 384), (384, 384), (1536, 384), (384, 1536), (16, 32)]


def bf16_case(rows: int, n: int, k: int, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    return x, w, b, ref


def assert_bf16_close(
    out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor | None = None, w: torch.Tensor | None = None
) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # float32 accumulation, one rounding to bf16: within 1 bf16 ulp (2^-8 relative) of the float32 result,
    # plus what summing in another order can move a float32 sum by: 2^-20 of its terms' magnitudes, |x| @
    # |w|.T, where given (a sum that cancels to near zero is only that exact; 1e-6 without them).
    slack = 1e-6 if x is None or w is None else (x.float().abs() @ w.float().abs().T) * 2.0**-20
    tol = ref.abs() * 2.0**-8 + slack
    assert bool(((out.float() - ref).abs() <= tol).all()), float((out.float() - ref).abs().max())


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 14, 16, 17, 100, 256, 600])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_at_few_rows_takes_the_kernel_and_matches_float32(rows, shape):
    if rows > linear.small_rows():
        pytest.skip(f"{rows} rows: past this path's {linear.small_rows()} (test_more_rows_keep_onednn)")
    x, w, b, ref = bf16_case(rows, *shape)
    direct = linear.small_linear(x, w, b, gelu=False)
    assert direct is not None  # the kernel took it
    assert_bf16_close(direct, ref, x, w)
    assert torch.equal(linear.dense(x, w, b), direct)  # and the layers' entry point is that path


def test_no_bias():
    x, w, _, ref = bf16_case(3, 384, 384, bias=False)
    out = linear.small_linear(x, w, None, gelu=False)
    assert out is not None
    assert_bf16_close(out, ref)


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_gelu_matches_float32_gelu(rows):
    if rows > linear.small_rows():
        pytest.skip(f"{rows} rows: past this path's {linear.small_rows()}")
    x, w, b, ref = bf16_case(rows, 1536, 384, seed=1)
    ref_gelu = F.gelu(ref)  # exact (erf)
    out = linear_act(x, w, b, "gelu")
    assert linear.small_linear(x, w, b, gelu=True) is not None
    assert_bf16_close(out, ref_gelu)
    # and it agrees with oneDNN's fused post-op to one bf16 rounding
    onednn = torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight(w), b, "gelu", [], "none")
    assert bool(((out.float() - onednn.float()).abs() <= onednn.float().abs() * 2.0**-7 + 1e-6).all())


def test_more_rows_keep_onednn():
    x, w, b, ref = bf16_case(linear.small_rows() + 1, 384, 384)
    assert linear.small_linear(x, w, b, gelu=False) is None
    expected = torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight(w), b, "none", [], "")
    assert torch.equal(linear.dense(x, w, b), expected)


def test_shapes_it_does_not_take_keep_onednn():
    x, w, b, ref = bf16_case(4, 40, 384)  # 40 outputs: not a whole number of 16-column blocks
    assert linear.small_linear(x, w, b, gelu=False) is None
    assert_bf16_close(linear.dense(x, w, b), ref)
    x, w, b, ref = bf16_case(4, 64, 48)  # 48 inputs: not a whole number of 32-input tiles
    assert linear.small_linear(x, w, b, gelu=False) is None
    assert_bf16_close(linear.dense(x, w, b), ref)


def test_batch_invariance_keeps_onednn_at_every_row_count(monkeypatch):
    x, w, b, _ = bf16_case(16, 384, 384)
    monkeypatch.setattr(invariance, "_ENABLED", True)
    assert linear.small_linear(x, w, b, gelu=False) is None
    one = linear.dense(x[:1], w, b)
    many = linear.dense(x, w, b)
    assert torch.equal(one[0], many[0])  # a row's result does not depend on the rows beside it


def test_weight_written_in_place_is_packed_again():
    x, w, b, _ = bf16_case(2, 384, 384)
    first = linear.small_linear(x, w, b, gelu=False)
    w.mul_(-1)
    again = linear.small_linear(x, w, b, gelu=False)
    assert again is not None and first is not None
    assert_bf16_close(again, x.float() @ w.float().T + b.float())


def dot_rows() -> int:
    """The dot products' rows at this process's thread count: 4,096, or 256 past two threads."""
    return 4096 if torch.get_num_threads() <= linear.THREADS_FOR_LONG else linear.LONG_CAP


def test_the_rows_each_path_takes(path):
    """16 on the tiles (where the CPU has AMX, unless EMBED_CPU_AMX=0), else as dot products."""
    tiles = {"amx_bf16", "amx_tile"} <= FLAGS and path == "fastest"
    assert linear.small_rows() == (16 if tiles else dot_rows())


def test_past_two_threads_a_long_batch_keeps_onednn(path):
    """The dot products split a matmul by column groups only: with more threads, past 256 rows oneDNN."""
    tiles = {"amx_bf16", "amx_tile"} <= FLAGS and path == "fastest"
    threads = torch.get_num_threads()
    torch.set_num_threads(linear.THREADS_FOR_LONG + 1)
    try:
        assert linear.small_rows() == (16 if tiles else linear.LONG_CAP)
        x, w, b, ref = bf16_case(linear.LONG_CAP + 1, 384, 384)
        assert linear.small_linear(x, w, b, gelu=False) is None
        assert_bf16_close(linear.dense(x, w, b), ref)
    finally:
        torch.set_num_threads(threads)
    assert linear.small_rows() == (16 if tiles else dot_rows())


def test_a_cap_of_zero_keeps_onednn(monkeypatch):
    monkeypatch.setattr(linear, "SMALL_ROWS", 0)
    x, w, b, _ = bf16_case(3, 384, 384)
    assert linear.small_linear(x, w, b, gelu=False) is None
    expected = torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight(w), b, "none", [], "")
    assert torch.equal(linear.dense(x, w, b), expected)
