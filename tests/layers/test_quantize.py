"""--quantization int8's linear layers (layers/quantize.py, csrc `quantize_rows` / `dequantize_rows`): exact
where the int8 grid holds the values, close to a float64 matmul elsewhere, GELU on the float32 sums, a row's
result independent of its batch, and the float32 reference pass of the fidelity check left unquantized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_service.layers import quantize
from embed_service.layers.activation import linear_act
from embed_service.layers.linear import dense
from embed_service.ops import fused

KERNEL = quantize._kernel() is not None
PATHS = [
    pytest.param(
        "kernel",
        marks=pytest.mark.skipif(not KERNEL, reason="the project's compiled kernel does not load here"),
    ),
    "torch",
]


@pytest.fixture
def path(request, monkeypatch):
    """Run the layers through the compiled kernel or through their torch form."""
    if request.param == "torch":
        monkeypatch.setattr(quantize, "_kernel", lambda: None)
    return request.param


def marked(w: torch.Tensor) -> torch.Tensor:
    w.int8 = True  # what linear.mark_int8 does to a model's body
    return w


def grid_case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """Integer activations spanning exactly [-128, 127] per row and integer weights reaching 127 per output
    feature: every scale is 1 and every zero point 0, so the int8 layer must return x @ w.T + b exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (rows, k), generator=g).double()
    x[:, 0], x[:, 1] = -128, 127
    w = torch.randint(-127, 128, (n, k), generator=g).double()
    w[:, 2] = 127
    b = torch.randint(-256, 257, (n,), generator=g).double()  # integers bf16 holds exactly
    return x.to(dtype), marked(w.to(dtype)), b.to(dtype), x @ w.T + b


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_values_on_the_grid_are_exact(path, dtype, rows):
    x, w, b, exact = grid_case(rows, 96, 64, dtype)
    assert torch.equal(dense(x, w, b), exact.to(dtype))  # rounded once, from the exact integer sums


def random_case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different ranges and signs: all positive (a GELU's output), centred, shifted
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    x[::3] = x[::3].abs()
    x[1::3] += 3.0
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    x, w, b = x.to(dtype), marked(w.to(dtype)), b.to(dtype)
    return x, w, b, F.linear(x.double(), w.double(), b.double())


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_stay_close_to_a_float64_matmul(path, dtype):
    x, w, b, ref = random_case(48, 1152, 384, dtype)
    out = dense(x, w, b).double()
    # Per output: within the rounding of both operands to 256 steps (half a step of each, times the weights).
    step_x = ((x.double().amax(1).clamp(min=0) - x.double().amin(1).clamp(max=0)) / 255)[:, None]
    step_w = (w.double().abs().amax(1) / 127)[None, :]
    bound = 0.5 * step_x * w.double().abs().sum(1)[None, :] + 0.5 * step_w * x.double().abs().sum(1)[:, None]
    slack = ref.abs() * 2**-7 + 1e-3  # the output's own rounding (bf16)
    assert ((out - ref).abs() <= bound + slack).all()
    assert F.cosine_similarity(out, ref, dim=1).min() > 0.999


@pytest.mark.skipif(not KERNEL, reason="the project's compiled kernel does not load here")
def test_the_kernel_and_its_torch_form_agree():
    x, w, b, _ = random_case(33, 384, 1536, torch.bfloat16, seed=1)
    q, s, z = quantize._kernel().quantize_rows(x)
    rq, rs, rz = quantize.quantize_rows_reference(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert torch.equal(z, rz)
    assert (q.int() - rq.int()).abs().max() <= 1 and (q != rq).float().mean() < 1e-2  # rounding near halves
    weight = quantize.quantize_weight(w)
    acc = torch._int_mm(q, weight.values.t())
    exact = (acc - z[:, None] * weight.sums).double() * s.double()[
        :, None
    ] * weight.scale.double() + b.double()
    for gelu in (False, True):
        out = quantize._kernel().dequantize_rows(
            acc, s, z, weight.scale, weight.sums, b, gelu, torch.bfloat16
        )
        ref = F.gelu(exact) if gelu else exact
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5)  # one bf16 rounding


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_gelu_runs_on_the_float32_sums(path):
    x, w, b, exact = grid_case(20, 64, 32, torch.float32)
    w = marked((w / 1000).contiguous())  # on the grid still (scale 127 / 1000), sums of moderate size
    out = linear_act(x, w, b, "gelu")
    ref = F.gelu(x.double() @ w.double().T + b.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_a_rows_result_does_not_depend_on_its_batch(path):
    x, w, b, _ = random_case(37, 384, 384, torch.bfloat16, seed=2)
    together = dense(x, w, b)
    for i in (0, 5, 36):
        assert torch.equal(dense(x[i : i + 1].contiguous(), w, b), together[i : i + 1])


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_a_row_of_zeros_gives_the_bias(path):
    x, w, b, _ = random_case(4, 64, 32, torch.float32)
    x[2] = 0
    assert torch.equal(dense(x, w, b)[2], b)


def test_the_reference_pass_and_unmarked_weights_stay_unquantized():
    x, w, b, _ = random_case(9, 64, 32, torch.float32)
    plain = F.linear(x, w, b)
    assert not torch.equal(dense(x, w, b), plain)  # marked: int8
    with fused.reference_only():  # the fidelity check's float32 pass
        assert torch.equal(dense(x, w, b), plain)
    assert torch.equal(dense(x, w.detach().clone(), b), plain)  # a weight no model marked


def test_a_weight_written_in_place_is_quantized_again():
    x, w, b, _ = random_case(5, 64, 32, torch.float32)
    dense(x, w, b)
    with torch.no_grad():
        w.mul_(-2)
    ref = F.linear(x.double(), w.double(), b.double())
    assert F.cosine_similarity(dense(x, w, b).double() - b.double(), ref - b.double(), dim=1).min() > 0.999


def test_a_model_is_marked_but_its_query_key_value_projections():
    from embed_service.layers.linear import mark_int8
    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.server import default_model_path

    model = EmbeddingModel(load_spec(str(default_model_path())), torch.bfloat16, torch.device("cpu"))
    assert mark_int8(model) == 18  # 6 layers: attention output, MLP in and out
    marked = {n for n, m in model.named_modules() if getattr(getattr(m, "weight", None), "int8", False)}
    assert len(marked) == 18 and not any("qkv" in n for n in marked) and all(".layer." in n for n in marked)


def test_where_int8_is_refused():
    vnni = {"avx512f", "avx512_vnni"}
    assert quantize.unsupported("cpu", False, vnni) is None
    assert quantize.unsupported("cpu", False, {"amx_int8"}) is None
    assert "CPUs only" in quantize.unsupported("cuda", False, vnni)
    assert "encoder models only" in quantize.unsupported("cpu", True, vnni)
    assert "needs a CPU with VNNI" in quantize.unsupported("cpu", False, {"avx2", "avx512f"})
