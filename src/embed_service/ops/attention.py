"""Variable-length attention over the flat token stream.

flash-attn's varlen kernel on CUDA when it is installed; elsewhere the stream is scattered into a padded
(B, H, L, D) grid for torch's scaled_dot_product_attention and gathered back. Padding exists only inside
this function. ``varlen_attention_reference`` is the plain per-sequence twin the tests compare against.

``window`` restricts each query to keys at most that many positions away (sliding-window attention, as in
ModernBERT's local layers and Mistral); with ``causal`` only the keys behind the query count.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from embed_service.ops.batch import FlatBatch

try:  # optional: the `gpu` extra
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match this torch
    flash_attn_varlen_func = None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: FlatBatch,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) with Hq a multiple of Hkv -> (T, Hq, D).

    window: keys farther than this from the query (|i - j| > window) are masked; None for no limit.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if window is not None and window >= batch.max_seqlen - 1:
        window = None  # the window covers every sequence of this batch
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_varlen_func(
            q,
            k,
            v,
            batch.cu_seqlens,
            batch.cu_seqlens,
            batch.max_seqlen,
            batch.max_seqlen,
            softmax_scale=scale,
            causal=causal,
            window_size=(-1, -1) if window is None else (window, 0 if causal else window),
        )
    gqa = q.shape[1] != k.shape[1]
    if batch.num_seqs == 1 and window is None:
        # (1, H, T, D): no padding at all.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)
    pad_index, key_valid = batch.padded_layout()
    b, L = key_valid.shape

    def to_grid(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(b * L, x.shape[1], x.shape[2])
        grid[pad_index] = x
        return grid.view(b, L, x.shape[1], x.shape[2]).transpose(1, 2)  # (B, H, L, D)

    mask = key_valid[:, None, None, :]  # (B, 1, 1, L): True where a key is real
    if causal or window is not None:
        mask = mask & _allowed(L, causal, window, q.device)
    out = F.scaled_dot_product_attention(
        to_grid(q), to_grid(k), to_grid(v), attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return out.transpose(1, 2).reshape(b * L, q.shape[1], q.shape[2])[pad_index]


def _allowed(n: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """(n, n) bool: may query i attend to key j."""
    offset = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]  # i - j
    allowed = offset >= 0 if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & (offset.abs() <= window)
    return allowed


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence at a time, softmax written out, in float32."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].float().transpose(0, 1)  # (H, n, D)
        ks = k[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale  # (H, n, n)
        if causal or window is not None:
            scores = scores.masked_fill(~_allowed(e - s, causal, window, scores.device), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out
