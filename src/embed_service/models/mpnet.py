"""MPNet: BERT's post-norm layers plus a relative position bias added to every attention score.

The bias is one learned value per (bucket, head), the bucket a function of the key's offset from the query
(T5's scheme: exact below 8, logarithmic up to 128, direction kept), and one table serves every layer. It
depends only on positions within a sequence, so it is computed once per batch for the longest sequence and
each sequence attends with its top-left corner (ops/scored_attention.py). transformers always buckets into
32 (whatever ``relative_attention_num_buckets`` says), so this does too. Learned absolute positions start
after the padding index 1, as RoBERTa's do (the registry's fixed offset of 2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from embed_service.layers.linear import RowParallelLinear, default_weight_loader
from embed_service.layers.norm import LayerNorm
from embed_service.models.bert import BertIntermediate, BertOutput
from embed_service.models.encoder import AbsoluteEmbeddings, LayerStack, PackedSelfAttention
from embed_service.models.spec import ModelSpec
from embed_service.ops.batch import FlatBatch
from embed_service.ops.scored_attention import varlen_attention_scored
from embed_service.parallel import tp_rank, tp_world_size

NUM_BUCKETS, MAX_DISTANCE = 32, 128  # transformers' compute_position_bias defaults, used for every model


def relative_position_bucket(relative: torch.Tensor) -> torch.Tensor:
    """Key offset from the query (j - i) -> bucket in [0, 32), as transformers' MPNet computes it."""
    half = NUM_BUCKETS // 2
    n = -relative
    ret = (n < 0).long() * half
    n = n.abs()
    max_exact = half // 2
    large = (
        max_exact
        + (torch.log(n.float() / max_exact) / math.log(MAX_DISTANCE / max_exact) * (half - max_exact)).long()
    )
    large = large.clamp(max=half - 1)
    return ret + torch.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """The (buckets, heads) table, this rank's heads only, and the (heads_r, L, L) bias of a batch."""

    def __init__(self, buckets: int, heads: int):
        super().__init__()
        self.per_rank = heads // tp_world_size()  # the attention layers have checked the heads divide
        self.weight = nn.Parameter(torch.empty(buckets, self.per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded.narrow(1, tp_rank() * self.per_rank, self.per_rank))

    def forward(self, length: int) -> torch.Tensor:
        pos = torch.arange(length, device=self.weight.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None])  # (L, L): query i, key j
        return self.weight[buckets].permute(2, 0, 1)  # (heads_r, L, L)


class MPNetSelfAttention(PackedSelfAttention):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.o = RowParallelLinear(cfg["hidden_size"], cfg["hidden_size"], what="hidden size")

    def forward(self, x: torch.Tensor, batch: FlatBatch, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        out = varlen_attention_scored(q, k, v, batch, causal=False, bias=bias)  # (T, heads_r, D)
        return self.o(self.merge(out))


class MPNetAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.attn = MPNetSelfAttention(cfg)
        self.LayerNorm = LayerNorm(cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, batch: FlatBatch, bias: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.attn(x, batch, bias) + x)


class MPNetLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.attention = MPNetAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg["intermediate_size"], cfg)

    def forward(self, x: torch.Tensor, batch: FlatBatch, bias: torch.Tensor) -> torch.Tensor:
        h = self.attention(x, batch, bias)
        return self.output(self.intermediate(h), h)


class MPNetEncoder(LayerStack):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg, MPNetLayer)
        self.relative_attention_bias = RelativePositionBias(
            cfg.get("relative_attention_num_buckets", NUM_BUCKETS), cfg["num_attention_heads"]
        )

    def forward(self, x: torch.Tensor, batch: FlatBatch, *extra: torch.Tensor) -> torch.Tensor:
        bias = self.relative_attention_bias(batch.max_seqlen).to(x.dtype)  # shared by every layer
        return super().forward(x, batch, bias, *extra)


class MPNetModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states."""

    packed_modules_mapping = {
        "attention.attn.q.": ("attention.attn.qkv_proj.", "q"),
        "attention.attn.k.": ("attention.attn.qkv_proj.", "k"),
        "attention.attn.v.": ("attention.attn.qkv_proj.", "v"),
    }
    checkpoint_prefixes = ("mpnet.",)
    ignored_weights = ("pooler.", "lm_head.", "embeddings.position_ids")

    def __init__(self, spec: ModelSpec):
        super().__init__()
        # No token types: positions after the padding index, as RoBERTa's.
        self.embeddings = AbsoluteEmbeddings(spec.config, spec.position_offset, token_types=False)
        self.encoder = MPNetEncoder(spec.config)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.encoder(self.embeddings(batch), batch)
