"""BERT-family bidirectional encoder on the flat token stream.

Module names mirror the Hugging Face checkpoint, so weights load without renaming except the packed
query/key/value projection. ``position_offset`` lets RoBERTa and XLM-RoBERTa (positions start after the
padding index) reuse this file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embed_service.layers.activation import get_activation, linear_act
from embed_service.layers.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from embed_service.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from embed_service.layers.norm import LayerNorm
from embed_service.models.spec import ModelSpec
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any], position_offset: int):
        super().__init__()
        h = cfg["hidden_size"]
        self.position_offset = position_offset
        self.word_embeddings = VocabParallelEmbedding(cfg["vocab_size"], h)
        self.position_embeddings = ReplicatedEmbedding(cfg["max_position_embeddings"], h)
        self.type_vocab_size = cfg.get("type_vocab_size", 0)
        if self.type_vocab_size:
            self.token_type_embeddings = ReplicatedEmbedding(self.type_vocab_size, h)
        self.LayerNorm = LayerNorm(h, cfg.get("layer_norm_eps", 1e-12))

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids) + self.position_embeddings(
            batch.positions + self.position_offset
        )
        if self.type_vocab_size:
            # Single-text inputs: every token is segment 0.
            x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = h // heads
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, 3 * heads_r * D)
        q, k, v = qkv.view(x.shape[0], 3 * self.num_heads, self.head_dim).split(self.num_heads, dim=1)
        out = varlen_attention(q, k, v, batch, causal=False)  # (T, heads_r, D)
        return out.reshape(x.shape[0], self.num_heads * self.head_dim)


class BertOutput(nn.Module):
    """dense -> residual -> LayerNorm (post-norm), shared by the attention and the MLP halves."""

    def __init__(self, in_features: int, cfg: dict[str, Any]):
        super().__init__()
        self.dense = RowParallelLinear(in_features, cfg["hidden_size"])
        self.LayerNorm = LayerNorm(cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x), residual)[0]  # the add fused into the norm where it can be


class BertAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertOutput(cfg["hidden_size"], cfg)

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.dense = ColumnParallelLinear(
            cfg["hidden_size"], cfg["intermediate_size"], what="intermediate size"
        )
        self.act_name = cfg.get("hidden_act", "gelu")
        get_activation(self.act_name)  # refuse an unknown activation at build time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_act(x, self.dense.weight, self.dense.bias, self.act_name)  # fused where it can be


class BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg["intermediate_size"], cfg)

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        h = self.attention(x, batch)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, batch)
        return x


class BertModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states."""

    # checkpoint name fragment -> (module fragment, shard id)
    packed_modules_mapping = {
        "attention.self.query.": ("attention.self.qkv_proj.", "q"),
        "attention.self.key.": ("attention.self.qkv_proj.", "k"),
        "attention.self.value.": ("attention.self.qkv_proj.", "v"),
    }
    checkpoint_prefixes = ("bert.", "model.")
    ignored_weights = ("pooler.", "cls.", "embeddings.position_ids", "lm_head.")

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.config
        self.embeddings = BertEmbeddings(cfg, spec.position_offset)
        self.encoder = BertEncoder(cfg)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.encoder(self.embeddings(batch), batch)


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's layers; positions start after the padding index (the spec's offset)."""

    checkpoint_prefixes = ("roberta.",)
