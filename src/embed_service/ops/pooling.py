"""Pooling on the flat token stream, in float32. The pooled token comes from cu_seqlens, never from padding.

The functions here are the references of the pooling kernel (kernels/pooling.py); ``pool`` is the entry
point that takes the kernel where ops/fused.py chose it (mean, CLS, last token), fused with the Matryoshka
slice and L2 normalization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embed_service.ops import fused


def pool_cls(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T, H) -> (B, H): each sequence's first token."""
    return hidden[cu_seqlens[:-1].long()].float()


def pool_last_token(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T, H) -> (B, H): each sequence's last token."""
    return hidden[cu_seqlens[1:].long() - 1].float()


def _segment_ids(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens), lens


def pool_mean(hidden: torch.Tensor, cu_seqlens: torch.Tensor, sqrt_len: bool = False) -> torch.Tensor:
    """(T, H) -> (B, H): the mean of each sequence's tokens (or the sum over sqrt(length))."""
    seg, lens = _segment_ids(cu_seqlens)
    sums = torch.zeros(lens.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seg, hidden.float())
    denom = lens.float().sqrt() if sqrt_len else lens.float()
    return sums / denom.clamp(min=1)[:, None]


def pool_max(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    seg, lens = _segment_ids(cu_seqlens)
    out = torch.full(
        (lens.numel(), hidden.shape[1]), float("-inf"), dtype=torch.float32, device=hidden.device
    )
    index = seg[:, None].expand(-1, hidden.shape[1])
    return out.scatter_reduce_(0, index, hidden.float(), "amax", include_self=True)


REFERENCES = {
    "cls": pool_cls,
    "mean": pool_mean,
    "mean_sqrt_len": lambda h, cu: pool_mean(h, cu, sqrt_len=True),
    "max": pool_max,
    "last": pool_last_token,
}


def pool(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    dimensions: int | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """(T, H) -> (B, dimensions or H) float32: pooled by `mode`, the first `dimensions` features kept, then
    L2-normalized (as F.normalize) when asked."""
    k = fused.kernels()
    if k is not None and mode in ("mean", "cls", "last"):
        return k.pool_normalize(hidden, cu_seqlens, mode, dimensions, normalize)
    pooled = REFERENCES[mode](hidden, cu_seqlens)
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, dim=-1) if normalize else pooled


# By the names ModelSpec.pooling uses: (T, H), cu_seqlens -> (B, H) float32.
POOLERS = {name: (lambda h, cu, name=name: pool(h, cu, name)) for name in REFERENCES}
