"""BERT-family bidirectional encoder on the flat token stream.

Module names mirror the Hugging Face checkpoint, so weights load without renaming except the packed
query/key/value projection. ``position_offset`` lets RoBERTa and XLM-RoBERTa (positions start after the
padding index) reuse this file.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers.activation import get_activation, linear_act
from embed_service.layers.embedding import VocabParallelEmbedding
from embed_service.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from embed_service.layers.norm import LayerNorm
from embed_service.models.encoder import AbsoluteEmbeddings, LayerStack, PackedSelfAttention
from embed_service.models.spec import ModelSpec
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch


class BertEmbeddings(AbsoluteEmbeddings):
    """word + position (after ``position_offset``) + token type embeddings, then LayerNorm."""


class BertSelfAttention(PackedSelfAttention):
    def forward(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.merge(varlen_attention(q, k, v, batch, causal=False))  # (T, heads_r * D)


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


class BertEncoder(LayerStack):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg, BertLayer)


class BertModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states."""

    # checkpoint name fragment -> (module fragment, shard id)
    packed_modules_mapping = {
        "attention.self.query.": ("attention.self.qkv_proj.", "q"),
        "attention.self.key.": ("attention.self.qkv_proj.", "k"),
        "attention.self.value.": ("attention.self.qkv_proj.", "v"),
    }
    checkpoint_prefixes: tuple[str, ...] = ("bert.", "model.")
    # The pooler and a classifier belong to the scoring head (models/scoring.py), which loads them itself
    # (a prefix is only stripped before this model's own modules: "bert.pooler." stays as it is).
    ignored_weights = (
        "pooler.",
        "cls.",
        "embeddings.position_ids",
        "lm_head.",
        "classifier.",
        "bert.pooler.",
    )

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.config
        self.embeddings = BertEmbeddings(cfg, spec.position_offset)
        self.encoder = BertEncoder(cfg)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.encoder(self.embeddings(batch), batch)

    mlm_head_name = "cls"  # where the checkpoint keeps the masked-LM head

    def add_mlm_head(self, cfg: dict[str, Any]) -> None:
        """Build the masked-LM head, under its checkpoint name (SPLADE models only: a plain embedder never
        holds the vocabulary-size head)."""
        head = MLM_HEADS[self.mlm_head_name](cfg, self.embeddings.word_embeddings)
        self.add_module(self.mlm_head_name, head)

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, V_r): the logits of this rank's rows of the vocabulary."""
        return getattr(self, self.mlm_head_name)(hidden, self.embeddings.word_embeddings.weight)


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's layers; positions start after the padding index (the spec's offset)."""

    checkpoint_prefixes = ("roberta.",)
    mlm_head_name = "lm_head"


# --- The masked-LM heads (SPLADE models; models/heads.py pools their logits) ---------------------------
# transform (dense, activation, LayerNorm), then the decoder: the word embeddings (tied, as transformers
# ties them unless tie_word_embeddings is false) plus a bias. Vocabulary-parallel like the embeddings: each
# rank scores its own rows of the table (padded rows score 0), so tensor parallelism splits the head's
# matmul, the largest of a SPLADE model, and nothing is copied.


class _MaskedLMDecoder(nn.Module):
    """The decoder's bias, and its own weight when the checkpoint does not tie it to the word embeddings."""

    def __init__(self, cfg: dict[str, Any], table: VocabParallelEmbedding):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(table.per_rank), requires_grad=False)
        self.bias.weight_loader = table.weight_loader  # type: ignore[attr-defined]  # this rank's rows
        self.tied = cfg.get("tie_word_embeddings", True) is not False
        if not self.tied:
            self.decoder = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])

    def decode(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.linear(x, table if self.tied else self.decoder.weight, self.bias)  # (N, V_r)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.dense = ReplicatedLinear(cfg["hidden_size"], cfg["hidden_size"])
        self.act = get_activation(cfg.get("hidden_act", "gelu"))
        self.LayerNorm = LayerNorm(cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(_MaskedLMDecoder):
    def __init__(self, cfg: dict[str, Any], table: VocabParallelEmbedding):
        super().__init__(cfg, table)
        self.transform = BertPredictionHeadTransform(cfg)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.decode(self.transform(x), table)


class BertOnlyMLMHead(nn.Module):
    """``cls.predictions.*`` of BertForMaskedLM (and BertForPreTraining)."""

    def __init__(self, cfg: dict[str, Any], table: VocabParallelEmbedding):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, table)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.predictions(x, table)


class RobertaLMHead(_MaskedLMDecoder):
    """``lm_head.*`` of RobertaForMaskedLM and XLMRobertaForMaskedLM: exact GELU whatever hidden_act says."""

    def __init__(self, cfg: dict[str, Any], table: VocabParallelEmbedding):
        super().__init__(cfg, table)
        self.dense = ReplicatedLinear(cfg["hidden_size"], cfg["hidden_size"])
        self.layer_norm = LayerNorm(cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5))

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.decode(self.layer_norm(F.gelu(self.dense(x))), table)


MLM_HEADS: dict[str, type[nn.Module]] = {"cls": BertOnlyMLMHead, "lm_head": RobertaLMHead}
