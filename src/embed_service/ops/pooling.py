"""Pooling on the flat token stream, in float32. The pooled token comes from cu_seqlens, never from padding."""

from __future__ import annotations

import torch


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


POOLERS = {
    "cls": pool_cls,
    "mean": pool_mean,
    "mean_sqrt_len": lambda h, cu: pool_mean(h, cu, sqrt_len=True),
    "max": pool_max,
    "last": pool_last_token,
}
