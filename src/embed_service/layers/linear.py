"""Linear layers that know their tensor-parallel shard.

Each parameter carries a ``weight_loader`` that narrows the full checkpoint tensor to this rank's slice, so a
model is written once and runs at any tensor-parallel size. At size 1 every slice is the whole tensor.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers import quantize
from embed_service.ops import invariance
from embed_service.ops.cpu_kernels import AttentionKernel, attention_kernel
from embed_service.parallel import all_reduce, tp_rank, tp_world_size


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except Exception:
        return False


ONEDNN_LINEAR = _onednn_linear_available()


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, the one matmul entry point of the layers.

    On a CPU in bfloat16 it calls oneDNN's matmul primitive directly (the kernel torch.compile emits for
    linear layers), which F.linear reaches only through aten's addmm and its checks and copies. Measured
    on this project's 2-core AMX machine, interleaved, median of 15 calls, (tokens, 384) x (384, out):
    0.36 -> 0.55 TFLOP/s at 9.5k tokens and 1.05 -> 1.30 at 2k tokens for out = 1152; float32 gains
    nothing (both are MKL's sgemm underneath), so it keeps F.linear.

    With batch invariance on (ops/invariance.py), 2-D inputs go through in fixed tiles of rows.
    """
    if invariance.enabled() and x.dim() == 2:
        return invariance.tiled(lambda rows: _dense(rows, weight, bias), x)
    return _dense(x, weight, bias)


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if quantize.applies(x, weight):  # --quantization int8
        return quantize.linear(x, int8_weight(weight), bias, gelu=False)
    if onednn_bf16(x, weight):
        out = small_linear(x, weight, bias, gelu=False)
        if out is not None:
            return out
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


# A cap on the rows `small_linear` takes, below the kernel's own limit (small_linear_rows: 16 on the AMX
# tiles, 4,096 as AVX512-BF16 dot products); None: no cap, 0: never (benchmarks compare with oneDNN alone).
SMALL_ROWS: int | None = None
# The dot products split a matmul over its 64-column groups only (6 for a 384-wide output), oneDNN over rows
# too: with more threads than THREADS_FOR_LONG, batches past LONG_CAP rows keep oneDNN. Measured (faster or
# as fast as oneDNN at every count up to 4,096) at one and two threads only.
THREADS_FOR_LONG = 2
LONG_CAP = 256


@functools.cache
def _small_kernel() -> tuple[AttentionKernel | None, int]:
    """The project's compiled kernel and the most rows its small linear takes here, where it runs (decided
    once per process)."""
    kernel = attention_kernel()
    rows = kernel.small_linear_rows() if kernel is not None else 0
    return (kernel, rows) if rows > 0 else (None, 0)


def small_rows() -> int:
    """The most rows a bf16 linear layer runs through `small_linear` in this process at its present
    thread count (0: none)."""
    rows = _small_kernel()[1]
    if torch.get_num_threads() > THREADS_FOR_LONG:
        rows = min(rows, LONG_CAP)
    return rows if SMALL_ROWS is None else min(rows, SMALL_ROWS)


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool
) -> torch.Tensor | None:
    """x @ weight.T + bias for 1 to small_rows() rows of bf16, through the project's kernel (ops/csrc:
    `small_linear`: on the AMX tiles, else as AVX512-BF16 dot products), with exact GELU on the float32 sum
    when `gelu` (as oneDNN's post-op); None where it does not apply (more rows, neither instruction set,
    batch invariance on, a shape it does not take), and the caller's oneDNN path runs.

    oneDNN's matmul at these rows reads its packed weights at a quarter to a half of what one thread can
    read, and a short sequence's forward is that read (docs/performance.md, "Small batches"); the kernel
    loads each weight once per call (per 16 rows on the dot path). Accumulation is float32 in both, so
    results agree to bf16 rounding, not bit for bit: with batch invariance on (ops/invariance.py) every row
    count keeps oneDNN.
    """
    if x.shape[0] > small_rows() or invariance.enabled() or not x.is_contiguous():
        return None
    kernel = _small_kernel()[0]
    if kernel is None:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    packed = _small_weight(weight)
    if packed is None:
        return None
    return kernel.small_linear(x, packed, bias, weight.shape[0], gelu)


def pack_small_linear(weight: torch.Tensor) -> torch.Tensor:
    """A (N, K) bf16 weight in `small_linear`'s layout: [N/16][K/32][16 input pairs][16 columns][2] (the
    tiles' layout; read as 32-bit pairs, [N/16][K/2][16], the dot products')."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def small_linear_serves(weight: torch.Tensor) -> bool:
    """Whether `small_linear` serves matmuls with this weight at up to small_rows() rows (batch invariance
    off): bf16 on a CPU, a shape the kernel takes, not marked for int8, its packed copy kept (made here if it
    is not yet, as the first such matmul would make it). Such a matmul generates no code per row count and
    computes each row on its own."""
    return (
        small_rows() > 0
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and not getattr(weight, "int8", False)
        and _small_weight(weight) is not None
    )


def _small_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in small_linear's layout, kept beside it like `packed_weight`'s copy; None for a shape the
    kernel does not take (N a multiple of 16, K of 32) or past the budget."""
    n, k = weight.shape
    if n % 16 or k % 32:
        return None
    packed = _kept_copy(weight, "_small_packed", lambda w: pack_small_linear(w.detach()))
    return None if packed is weight else packed


# The token count oneDNN is told to lay packed weights out for; the layout serves every count.
PACK_HINT_TOKENS = 1024
# The most bytes of packed copies one process keeps: past it, weights stay plain (oneDNN reorders them per
# call, as before). The gain is largest for small models at small batches; a large model's matmuls are big
# enough that the reorder is a small share, and a copy of its weights would not fit beside it.
PACK_BUDGET_BYTES = 256 << 20
_packed_bytes = 0


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight in oneDNN's own blocked layout, for ``mkldnn._linear_pointwise``: packed on first use
    and kept beside the weight (a second copy of it, within ``PACK_BUDGET_BYTES`` per process), packed again
    if the weight is written in place or given new data.

    Given the plain (out, in) weight, oneDNN reorders it into that layout on every call; packed once (as
    torch.compile's freezing does), the matmul skips it (figures in docs/performance.md); the outputs are
    bit for bit the same.
    """
    return _kept_copy(weight, "_onednn_packed", _onednn_reorder)


def int8_weight(weight: torch.Tensor) -> quantize.Int8Weight:
    """A weight marked by `mark_int8` as its int8 copy: made on first use and kept beside it like
    `packed_weight`'s (counted in `packed_bytes`, outside its budget: an int8 model runs int8 throughout)."""
    return _kept_copy(weight, "_int8", quantize.quantize_weight, budget=False)


def _onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_TOKENS)
    except (AttributeError, RuntimeError):  # a torch without it: the plain weight serves
        return weight


def _kept_copy(weight: torch.Tensor, attr: str, make, budget: bool = True):
    """`make(weight)`, made on first use and kept beside the weight as `attr` (within ``PACK_BUDGET_BYTES``
    per process unless not `budget`, counted by `packed_bytes`), made again if the weight is written in place
    or given new data; the weight itself where the budget is spent or `make` returns it."""
    global _packed_bytes
    version = (weight._version, weight.data_ptr())  # written in place, or given new data (`.data = ...`)
    cached = getattr(weight, attr, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    fits = not budget or _packed_bytes + weight.nbytes <= PACK_BUDGET_BYTES
    copy = make(weight) if fits else weight
    if copy is not weight:
        _packed_bytes += copy.nbytes
        weakref.finalize(copy, _release, copy.nbytes)  # when its weight dies or is made again
    setattr(weight, attr, (version, copy))
    return copy


def _release(nbytes: int) -> None:
    global _packed_bytes
    _packed_bytes -= nbytes


def packed_bytes() -> int:
    """Bytes of packed weight copies this process holds (reported by /info beside the parameters)."""
    return _packed_bytes


def keeps_qkv(name: str, module: nn.Module) -> bool:
    """The default of `mark_int8`: query/key/value projections stay in the model's dtype (layers/quantize.py)."""
    return isinstance(module, QKVParallelLinear)


def mark_int8(model: nn.Module, keep: Callable[[str, nn.Module], bool] = keeps_qkv) -> int:
    """Mark the body's linear layers of `model` for --quantization int8 (their weights get an int8 copy on
    first use, `int8_weight`), except those `keep(name, module)` accepts; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not keep(name, module):
            module.weight.int8 = True  # type: ignore[attr-defined]
            count += 1
    return count


class Linear(nn.Linear):
    """torch's nn.Linear (same parameters, same state dict) whose matmul goes through ``dense``: the small
    float32 heads (classifiers, ColBERT, sparse), batch-invariant like the layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return dense(x.reshape(-1, x.shape[-1]), self.weight, self.bias).reshape(*x.shape[:-1], -1)
        return dense(x, self.weight, self.bias)


def onednn_bf16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this matmul goes straight to oneDNN: a CPU, bfloat16 input and weight, (tokens, features)."""
    return (
        ONEDNN_LINEAR
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 2
        and weight.dtype == torch.bfloat16
    )


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) does not divide by the tensor-parallel size ({denominator})")
    return numerator // denominator


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    """The whole weight on every rank (small heads such as a sentence-transformers Dense layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks: (T, in) -> (T, out / tp). No communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, what: str = "output features"):
        super().__init__()
        self.tp_size = tp_world_size()
        self.out_per_rank = divide(out_features, self.tp_size, what)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up of a SwiGLU MLP).

    Each rank holds its slice of every part, laid side by side: [gate_r | up_r].
    """

    def __init__(
        self, in_features: int, part_sizes: list[int], bias: bool = True, what: str = "intermediate size"
    ):
        self.part_sizes = part_sizes
        tp = tp_world_size()
        for size in part_sizes:
            divide(size, tp, what)
        super().__init__(in_features, sum(part_sizes), bias, what)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        tp = self.tp_size
        offset = sum(self.part_sizes[:shard_id]) // tp
        size = self.part_sizes[shard_id] // tp
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul; heads split across ranks: [q_r | k_r | v_r].

    Key/value heads may be fewer than query heads (grouped-query attention).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = True):
        tp = tp_world_size()
        divide(num_heads, tp, "query heads")
        divide(num_kv_heads, tp, "key/value heads")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = num_kv_heads // tp
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias, "query/key/value features")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, tp_rank() * size, size))


class RowParallelLinear(nn.Module):
    """Input features split across ranks: (T, in / tp) -> (T, out), summed over ranks; bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, what: str = "input features"):
        super().__init__()
        self.tp_size = tp_world_size()
        self.in_per_rank = divide(in_features, self.tp_size, what)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return dense(x, self.weight, self.bias)  # bias fused into the matmul
        y = all_reduce(dense(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y
