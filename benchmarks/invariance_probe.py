"""Which ops give a row a different result depending on what else is in the batch, on this machine.

Each op is run on one input alone and then with that input among others (more rows, another position,
other sequences beside it), and the bytes are compared. Run: ``python -m benchmarks.invariance_probe``
(``--threads N``). The findings per CPU kind are in docs/performance.md ("Batch invariance").
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.result_file import ResultFile
from embed_service.layers.activation import linear_act
from embed_service.layers.linear import dense
from embed_service.ops import invariance
from embed_service.ops.attention import varlen_attention, varlen_attention_torch
from embed_service.ops.batch import FlatBatch
from embed_service.ops.pooling import pool

ROWS = [*range(1, 70), 100, 127, 255, 256, 1000, 1001, 4097]
SHAPES = [(384, 1), (384, 384), (384, 1152), (384, 1536), (1536, 384), (1024, 1024)]
NEIGHBOURS = ([3], [200, 10], [64] * 30, [500, 7, 400])
FOUND: dict[str, dict[str, Any]] = {}  # per dtype, per op: the row counts that differ, or layouts differing


def note(dt: torch.dtype, op: str, found: Any) -> None:
    if isinstance(found, tuple):
        print(f"  {op}: {found[0]} of {found[1]} layouts differ")
        found = {"layouts_differ": found[0], "layouts": found[1]}
    else:
        print(f"  {op}: differs at M = {found}")
    FOUND.setdefault(str(dt).removeprefix("torch."), {})[op] = found


def _differs(fn, x: torch.Tensor) -> list[int]:
    """Row counts M at which the first row of fn(x[:M]) differs from fn(x[:1])."""
    ref = fn(x[:1])
    return [m for m in ROWS if not torch.equal(fn(x[:m])[:1], ref)]


def matmuls(dt: torch.dtype) -> None:
    for k, n in SHAPES:
        w, b = torch.randn(n, k).to(dt) * 0.05, torch.randn(n).to(dt)
        x = torch.randn(max(ROWS), k).to(dt)
        note(dt, f"dense {k}x{n}", _differs(lambda r, w=w, b=b: dense(r, w, b), x))
        note(dt, f"dense+gelu {k}x{n}", _differs(lambda r, w=w, b=b: linear_act(r, w, b, "gelu"), x))


def norms(dt: torch.dtype) -> None:
    x, g, b = torch.randn(max(ROWS), 384).to(dt), torch.randn(384).to(dt), torch.randn(384).to(dt)
    note(dt, "layer_norm", _differs(lambda r: F.layer_norm(r, (384,), g, b, 1e-12), x))

    def rms(r: torch.Tensor) -> torch.Tensor:
        rf = r.float()
        return rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6)

    note(dt, "rms_norm", _differs(rms, x))


def attention(dt: torch.dtype, fn, name: str) -> None:
    heads, dim = 12, 32
    for length in (5, 37, 128, 300):
        q, k, v = (torch.randn(length, heads, dim).to(dt) for _ in range(3))
        ref = fn(q, k, v, FlatBatch.from_lengths(torch.zeros(length), [length]), False, 0.17)
        bad = total = 0
        for others in NEIGHBOURS:
            for pos in range(len(others) + 1):
                lens = others[:pos] + [length] + others[pos:]
                s = sum(others[:pos])
                qq, kk, vv = (torch.randn(sum(lens), heads, dim).to(dt) for _ in range(3))
                qq[s : s + length], kk[s : s + length], vv[s : s + length] = q, k, v
                out = fn(qq, kk, vv, FlatBatch.from_lengths(torch.zeros(sum(lens)), lens), False, 0.17)
                bad += not torch.equal(out[s : s + length], ref)
                total += 1
        note(dt, f"attention {name} L={length}", (bad, total))


def pooling(dt: torch.dtype) -> None:
    h = torch.randn(77, 384).to(dt)
    for mode in ("mean", "cls", "max", "last"):
        ref = pool(h, torch.tensor([0, 77], dtype=torch.int32), mode, None, True)
        bad = total = 0
        for others in NEIGHBOURS:
            for pos in range(len(others) + 1):
                lens = others[:pos] + [77] + others[pos:]
                cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
                cu[1:] = torch.cumsum(torch.tensor(lens), 0)
                hh = torch.randn(int(cu[-1]), 384).to(dt)
                hh[cu[pos] : cu[pos] + 77] = h
                bad += not torch.equal(pool(hh, cu, mode, None, True)[pos : pos + 1], ref)
                total += 1
        note(dt, f"pool {mode}", (bad, total))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-invariant", action="store_true", help="with the fixed row tiles on")
    parser.add_argument("--json", help="write the findings to this result file")
    args = parser.parse_args()
    record = ResultFile()
    torch.set_num_threads(args.threads)
    invariance.set_enabled(args.batch_invariant)
    torch.manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        print(f"{dt}, {args.threads} threads, batch-invariant {args.batch_invariant}:")
        matmuls(dt)
        norms(dt)
        attention(dt, varlen_attention, "default")
        attention(dt, varlen_attention_torch, "torch-sdpa")
        pooling(dt)
    if args.json:
        record.write(
            args.json,
            {
                "threads": args.threads,
                "batch_invariant": args.batch_invariant,
                "torch": torch.__version__,
                "rows_tried": ROWS,
                "found": FOUND,
            },
        )


if __name__ == "__main__":
    main()
