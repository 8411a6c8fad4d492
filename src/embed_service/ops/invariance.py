"""Batch invariance: a sequence's result the same bytes whatever else is in its batch.

The token-budget batcher lays sequences end to end in one flat stream, so the row count of every matmul
depends on the neighbours a sequence happened to get. A GEMM library picks its kernel, its blocking and
its split of the reduction by the shape: MKL's float32 sgemm takes another path below 4 rows (measured,
docs/performance.md "Batch invariance"), oneDNN's bfloat16 kernels block by the row count on AMX, cuBLAS
picks split-K by it. With ``enabled()`` every matmul of the layers and heads runs in tiles of exactly
ROW_TILE rows (the last one padded with zeros), so a row always meets the same kernel with the same
reduction order, and torch's padded attention path attends one sequence at a time. The other ops are
per row or per sequence already (norms, activations, pooling, the CPU attention kernel: one thread per
(sequence, head)); the probe (benchmarks/invariance_probe.py) checks each.

Off by default: it costs 12% (bfloat16) to 30% (float32) of bulk throughput on a CPU, more on short
batches (docs/performance.md "Batch invariance"). ``--batch-invariant`` (``EMBED_BATCH_INVARIANT=1``)
turns it on; the process's choice is read once, from the environment the workers inherit.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ROW_TILE = 64
"""Rows per matmul call. A multiple of every blocking seen (16 on AVX-512, 16/32 on AMX tiles and
cuBLAS), small enough that a 16-token query pads at most 48 rows."""


def _from_env() -> bool:
    return os.environ.get("EMBED_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "yes", "on")


_ENABLED = _from_env()


def enabled() -> bool:
    return _ENABLED


def set_enabled(on: bool) -> None:
    """This process's choice; the environment variable too, so that workers started later inherit it."""
    global _ENABLED
    _ENABLED = on
    os.environ["EMBED_BATCH_INVARIANT"] = "1" if on else "0"


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over (M, K) rows, called on tiles of exactly ROW_TILE rows: (M, K) -> (M, N).

    fn must be row-wise (row i of its result depends on row i of its input only), as a linear layer is.
    """
    m = x.shape[0]
    if m == ROW_TILE:
        return fn(x)
    full = -(-m // ROW_TILE) * ROW_TILE
    if full != m:
        x = torch.cat([x, x.new_zeros(full - m, *x.shape[1:])])
    if full == ROW_TILE:
        return fn(x)[:m]
    return torch.cat([fn(x[i : i + ROW_TILE]) for i in range(0, full, ROW_TILE)])[:m]
