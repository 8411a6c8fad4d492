"""The pieces BERT's post-norm encoders share (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, MPNet), written once.

Each family's file keeps its checkpoint's module names (``attention.self``, ``attention``,
``attention.attn``, ...) and builds them from these: learned absolute-position embeddings, the packed
query/key/value projection with its per-head views, and the stack of layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from embed_service.layers.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from embed_service.layers.linear import QKVParallelLinear
from embed_service.layers.norm import LayerNorm
from embed_service.ops.batch import FlatBatch


class AbsoluteEmbeddings(nn.Module):
    """Word + learned absolute position (+ token type) embeddings, then LayerNorm.

    `position_offset`: where positions start (RoBERTa's after the padding index); `eps`: a fixed epsilon
    (DistilBERT's), else the config's; `token_types`: whether the config's token types apply.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        position_offset: int = 0,
        eps: float | None = None,
        token_types: bool = True,
    ):
        super().__init__()
        h = cfg["hidden_size"]
        self.position_offset = position_offset
        self.word_embeddings = VocabParallelEmbedding(cfg["vocab_size"], h)
        self.position_embeddings = ReplicatedEmbedding(cfg["max_position_embeddings"], h)
        self.type_vocab_size = cfg.get("type_vocab_size", 0) if token_types else 0
        if self.type_vocab_size:
            self.token_type_embeddings = ReplicatedEmbedding(self.type_vocab_size, h)
        self.LayerNorm = LayerNorm(h, cfg.get("layer_norm_eps", 1e-12) if eps is None else eps)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids) + self.position_embeddings(
            batch.positions + self.position_offset
        )
        if self.type_vocab_size:
            if batch.token_type_ids is None:  # single texts: every token is segment 0
                x = x + self.token_type_embeddings.weight[0]
            else:  # pairs (cross-encoders): the second text is segment 1
                x = x + self.token_type_embeddings(batch.token_type_ids)
        out: torch.Tensor = self.LayerNorm(x)
        return out


class PackedSelfAttention(nn.Module):
    """The packed q/k/v projection (``qkv_proj``, this rank's heads) and its per-head views; a family's
    attention module subclasses it and adds its attention call and output projection."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = h // heads
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, hidden) -> q, k, v, each (T, heads_r, D)."""
        qkv = self.qkv_proj(x).view(x.shape[0], 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.split(self.num_heads, dim=1)
        return q, k, v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """(T, heads_r, D) -> (T, heads_r * D)."""
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


class LayerStack(nn.Module):
    """``layer.0`` ... ``layer.{n-1}`` of `make_layer(cfg)`, each applied to the last one's output (and any
    per-batch `extra` every layer shares, such as MPNet's position bias)."""

    def __init__(self, cfg: dict[str, Any], make_layer: Callable[[dict[str, Any]], nn.Module]):
        super().__init__()
        self.layer = nn.ModuleList(make_layer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor, batch: FlatBatch, *extra: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, batch, *extra)
        return x
