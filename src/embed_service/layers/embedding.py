"""Embedding tables: the vocabulary split across ranks, padded up to a multiple of the size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers.linear import default_weight_loader
from embed_service.parallel import all_reduce, tp_rank, tp_world_size


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the table live on this rank.

    The vocabulary is padded up to a multiple of the tensor-parallel size (XLM-R's 250,002 rows do not divide
    by 4); padded rows are zero and never looked up. Lookups outside the rank's rows give zero, and the
    all-reduce assembles the full embedding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = tp_world_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // tp)
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.zero_()
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        if rows:
            param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ReplicatedEmbedding(nn.Module):
    """A small table held whole on every rank (positions, token types)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
