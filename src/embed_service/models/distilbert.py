"""DistilBERT: BERT's post-norm encoder under its own weight names, without token types.

Positions are learned (or fixed sinusoids, which checkpoints store as the same table), numbered from 0;
every LayerNorm uses eps 1e-12 whatever the config says, as transformers does. The config names its sizes
``dim``, ``n_heads``, ``n_layers`` and ``hidden_dim``; the registry maps them to the standard keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embed_service.layers.activation import get_activation, linear_act
from embed_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from embed_service.layers.norm import LayerNorm
from embed_service.models.encoder import AbsoluteEmbeddings, LayerStack, PackedSelfAttention
from embed_service.models.spec import ModelSpec
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch

EPS = 1e-12  # transformers' DistilBERT hard-codes it


class DistilBertSelfAttention(PackedSelfAttention):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.out_lin = RowParallelLinear(cfg["hidden_size"], cfg["hidden_size"], what="hidden size")

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.out_lin(self.merge(varlen_attention(q, k, v, batch, causal=False)))


class FFN(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.lin1 = ColumnParallelLinear(h, i, what="intermediate size")
        self.lin2 = RowParallelLinear(i, h, what="intermediate size")
        self.act_name = cfg.get("activation", "gelu")
        get_activation(self.act_name)  # refuse an unknown activation at build time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(linear_act(x, self.lin1.weight, self.lin1.bias, self.act_name))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h = cfg["hidden_size"]
        self.attention = DistilBertSelfAttention(cfg)
        self.sa_layer_norm = LayerNorm(h, EPS)
        self.ffn = FFN(cfg)
        self.output_layer_norm = LayerNorm(h, EPS)

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        h = self.sa_layer_norm(self.attention(x, batch) + x)
        return self.output_layer_norm(self.ffn(h) + h)


class DistilBertModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states."""

    packed_modules_mapping = {
        "attention.q_lin.": ("attention.qkv_proj.", "q"),
        "attention.k_lin.": ("attention.qkv_proj.", "k"),
        "attention.v_lin.": ("attention.qkv_proj.", "v"),
    }
    checkpoint_prefixes = ("distilbert.",)
    # The masked-LM and classification heads; an embedder needs none of them.
    ignored_weights = (
        "vocab_transform.",
        "vocab_layer_norm.",
        "vocab_projector.",
        "pre_classifier.",
        "classifier.",
        "embeddings.position_ids",
    )

    def __init__(self, spec: ModelSpec):
        super().__init__()
        # Positions from 0, no token types, eps 1e-12 whatever the config says (as transformers).
        self.embeddings = AbsoluteEmbeddings(spec.config, eps=EPS, token_types=False)
        self.transformer = LayerStack(spec.config, TransformerBlock)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.transformer(self.embeddings(batch), batch)
