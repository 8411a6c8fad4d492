"""The tensor-parallel layers, sharded over 1, 2 and 4 real processes (gloo), against unsharded torch.

Every rank builds the layer at its world size, loads its slice of one full random tensor through the
parameter's weight_loader, and runs the same input; the assembled output must equal F.linear / F.embedding
(and, for attention, a plain per-sequence softmax) on the full weights within 1e-5 in float32.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from embed_service import parallel
from embed_service.layers.activation import silu_and_mul
from embed_service.layers.embedding import VocabParallelEmbedding
from embed_service.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from embed_service.ops.attention import varlen_attention_reference

ATOL = 1e-5
HIDDEN = 20
VOCAB = 1003  # divides by neither 2 nor 4: the table is padded


def _full(g: torch.Generator, *shape: int) -> torch.Tensor:
    # Wide weights (std 0.3), so that a slice taken from the wrong offset changes the result clearly.
    return torch.randn(*shape, generator=g) * 0.3


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], shard=None) -> None:
    for name, param in module.named_parameters():
        if shard is None:
            param.weight_loader(param, tensors[name])
        else:
            param.weight_loader(param, tensors[name], shard)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _check_rank(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
    parallel.set_tensor_parallel(rank, world_size)
    g = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
    x = torch.randn(7, HIDDEN, generator=g)  # (T, hidden)

    # Column-parallel: each rank holds out/N rows of the weight; gathered, the full projection.
    inter = 24
    w1, b1 = _full(g, inter, HIDDEN), _full(g, inter)
    up = ColumnParallelLinear(HIDDEN, inter)
    assert up.weight.shape == (inter // world_size, HIDDEN)
    _load(up, {"weight": w1, "bias": b1})
    h = up(x)  # (T, inter / N)
    _close(parallel.all_gather_last_dim(h), F.linear(x, w1, b1), "column-parallel")

    # Column then row-parallel (a BERT MLP): the row layer's all-reduce sums the partial products.
    w2, b2 = _full(g, HIDDEN, inter), _full(g, HIDDEN)
    down = RowParallelLinear(inter, HIDDEN)
    assert down.weight.shape == (HIDDEN, inter // world_size)
    _load(down, {"weight": w2, "bias": b2})
    _close(down(F.gelu(h)), F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), "column -> row MLP")

    # Merged gate/up (a SwiGLU MLP), loaded part by part as a checkpoint holds them.
    wg, wu, wd = _full(g, inter, HIDDEN), _full(g, inter, HIDDEN), _full(g, HIDDEN, inter)
    gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], bias=False)
    assert gate_up.weight.shape == (2 * inter // world_size, HIDDEN)
    _load(gate_up, {"weight": wg}, 0)
    _load(gate_up, {"weight": wu}, 1)
    down_proj = RowParallelLinear(inter, HIDDEN, bias=False)
    _load(down_proj, {"weight": wd})
    want = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    _close(down_proj(silu_and_mul(gate_up(x))), want, "merged gate/up -> row (SwiGLU)")

    # QKV with grouped-query attention and a head_dim other than hidden / heads, then the output projection.
    heads, kv_heads, head_dim = 8, 4, 3
    wq, bq = _full(g, heads * head_dim, HIDDEN), _full(g, heads * head_dim)
    wk, bk = _full(g, kv_heads * head_dim, HIDDEN), _full(g, kv_heads * head_dim)
    wv, bv = _full(g, kv_heads * head_dim, HIDDEN), _full(g, kv_heads * head_dim)
    wo = _full(g, HIDDEN, heads * head_dim)
    qkv = QKVParallelLinear(HIDDEN, head_dim, heads, kv_heads, bias=True)
    for shard, (w, b) in {"q": (wq, bq), "k": (wk, bk), "v": (wv, bv)}.items():
        _load(qkv, {"weight": w, "bias": b}, shard)
    o_proj = RowParallelLinear(heads * head_dim, HIDDEN, bias=False)
    _load(o_proj, {"weight": wo})
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # two sequences, 3 and 4 tokens

    def attend(q, k, v, n_q, n_kv):
        t = x.shape[0]
        out = varlen_attention_reference(
            q.view(t, n_q, head_dim), k.view(t, n_kv, head_dim), v.view(t, n_kv, head_dim), cu, causal=True
        )
        return out.reshape(t, n_q * head_dim)

    hq, hkv = qkv.num_heads, qkv.num_kv_heads
    assert (hq, hkv) == (heads // world_size, kv_heads // world_size)
    q, k, v = qkv(x).split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    got = o_proj(attend(q, k, v, hq, hkv))
    full = attend(F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv), heads, kv_heads)
    _close(got, F.linear(full, wo), "QKV (GQA) -> attention -> row")

    # Vocab-parallel embedding: rows padded up to a multiple of N; every id, the last one included.
    table = _full(g, VOCAB, HIDDEN)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    assert emb.weight.shape == (-(-VOCAB // world_size), HIDDEN)
    _load(emb, {"weight": table})
    ids = torch.cat([torch.arange(VOCAB), torch.tensor([VOCAB - 1, 0, 500, 251, 250])])
    _close(emb(ids), F.embedding(ids, table), "vocab-parallel embedding")

    if world_size > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_layers_equal_unsharded(world_size):
    if world_size == 1:
        _check_rank(0, 1, 0)  # no process group: here, in this process
        return
    # forkserver: torch and this module are imported once, in the server, rather than once per rank.
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(
        _check_rank, args=(world_size, _free_port()), nprocs=world_size, join=True, start_method="forkserver"
    )


@pytest.fixture
def two_ranks():
    """This process as rank 0 of 2, without a process group: enough to build layers and see them refuse."""
    parallel.set_tensor_parallel(0, 2)
    yield
    parallel.set_tensor_parallel(0, 1)


def test_layers_name_the_numbers_that_do_not_divide(two_ranks):
    with pytest.raises(ValueError, match=r"query heads \(9\).*tensor-parallel size \(2\)"):
        QKVParallelLinear(36, 4, 9, 9)
    with pytest.raises(ValueError, match=r"key/value heads \(3\).*tensor-parallel size \(2\)"):
        QKVParallelLinear(32, 4, 8, 3)
    with pytest.raises(ValueError, match=r"intermediate size \(37\).*tensor-parallel size \(2\)"):
        MergedColumnParallelLinear(32, [37, 37])
    with pytest.raises(ValueError, match=r"\(37\).*tensor-parallel size \(2\)"):
        RowParallelLinear(37, 32)
    # The vocabulary need not divide: it is padded.
    assert VocabParallelEmbedding(VOCAB, 8).weight.shape == (502, 8)
