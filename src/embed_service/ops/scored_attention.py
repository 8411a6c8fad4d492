"""Variable-length attention whose scores are changed before the softmax: an additive per-head bias that
depends on the relative position (MPNet), or tanh soft-capping of the logits (Gemma 2).

Neither fits the fused kernels of ops/attention.py, so the sequences go through the same length groups,
padded into (B, H, L, D) grids: a bias alone rides in scaled_dot_product_attention's float mask; soft-capping
needs the scores themselves, written out in float32 (as the reference's eager path does, softmax in float32),
a bounded number of rows at a time. Without either it is plain ``varlen_attention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from embed_service.ops.attention import GROUP_RATIO, _allowed, varlen_attention
from embed_service.ops.batch import FlatBatch

# Score elements (B * H * L * L) materialized at once on the soft-capping path: 128 MiB of float32.
MAX_SCORE_ELEMENTS = 1 << 25


def varlen_attention_scored(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: FlatBatch,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D).

    bias: (Hq, L, L) with L >= the batch's longest sequence, added to the scaled scores of every sequence
    (query i, key j) before masking; it may only depend on positions, so one table serves every sequence.
    softcap: scores become softcap * tanh(scores / softcap) before the bias and the mask.
    """
    if bias is None and softcap is None:
        return varlen_attention(q, k, v, batch, causal, scale, window)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if window is not None and window >= batch.max_seqlen - 1:
        window = None
    out = torch.empty_like(q)
    group_size = q.shape[1] // k.shape[1]
    for group in batch.attention_groups(GROUP_RATIO):
        n = group.max_len
        mask = torch.zeros(1, 1, n, n, dtype=torch.float32, device=q.device)
        if bias is not None:
            mask = mask + bias[None, :, :n, :n].float()
        if causal or window is not None:
            mask = mask.masked_fill(~_allowed(n, causal, window, q.device), float("-inf"))
        rows_per_chunk = max(1, MAX_SCORE_ELEMENTS // (q.shape[1] * n * n))
        pieces = []
        for start in range(0, len(group.spans), rows_per_chunk):
            spans = group.spans[start : start + rows_per_chunk]
            m = mask
            if group.key_valid is not None:
                m = m.masked_fill(~group.key_valid[start : start + len(spans)], float("-inf"))
            qg, kg, vg = _grid(q, spans, n), _grid(k, spans, n), _grid(v, spans, n)
            if softcap is None:
                o = F.scaled_dot_product_attention(
                    qg, kg, vg, attn_mask=m.to(q.dtype), scale=scale, enable_gqa=group_size > 1
                )
            else:
                kg = kg.repeat_interleave(group_size, dim=1)
                vg = vg.repeat_interleave(group_size, dim=1)
                scores = qg.float() @ kg.float().transpose(-1, -2) * scale  # (B, H, L, L)
                scores = torch.tanh(scores / softcap) * softcap + m
                o = (scores.softmax(-1) @ vg.float()).to(q.dtype)
            pieces.append(o.transpose(1, 2))  # (B, L, H, D)
        o = torch.cat(pieces)
        rows = (
            o.reshape(-1, o.shape[2], o.shape[3]) if group.key_valid is None else o[group.key_valid[:, 0, 0]]
        )
        out.index_copy_(0, group.token_index, rows)
    return out


def _grid(x: torch.Tensor, spans: list[tuple[int, int]], n: int) -> torch.Tensor:
    """(T, H, D) -> (B, H, n, D): the spans' rows, zeros past each length (n: the group's longest)."""
    g = pad_sequence([x[s:e] for s, e in spans], batch_first=True).transpose(1, 2)
    return g if g.shape[2] == n else F.pad(g, (0, 0, 0, n - g.shape[2]))
