"""ModernBERT: a pre-norm bidirectional encoder with rotary positions, GeGLU and alternating local attention.

Every ``global_attn_every_n_layers``-th layer (or as ``layer_types`` says) attends to the whole sequence
with the global rope theta; the others see keys within ``local_attention / 2`` positions, with the local
theta. The checkpoint packs q/k/v into ``Wqkv`` and the MLP input and gate into ``Wi``; their loaders split
the packed tensor so each part is sharded by the packed layers like any separate projection.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers.activation import act_and_mul, get_activation
from embed_service.layers.embedding import VocabParallelEmbedding
from embed_service.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from embed_service.layers.norm import LayerNorm
from embed_service.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from embed_service.models.spec import ModelSpec
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch


def _load_packed(layer: Any, shard_ids: list[Any]) -> None:
    """Make a packed layer load a checkpoint tensor that holds its parts end to end along dim 0."""
    for param in layer.parameters(recurse=False):

        def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
            for shard_id, part in zip(shard_ids, loaded.chunk(len(shard_ids), dim=0)):
                layer.weight_loader(param, part, shard_id)

        param.weight_loader = load


def _norm(cfg: dict[str, Any]) -> LayerNorm:
    return LayerNorm(cfg["hidden_size"], cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """'full_attention' or 'sliding_attention' per layer, as transformers' ModernBertConfig derives them."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = cfg.get("global_attn_every_n_layers", 3)
    return ["sliding_attention" if i % every else "full_attention" for i in range(cfg["num_hidden_layers"])]


def rope_by_kind(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope settings for global and local layers, from either config layout."""
    nested = cfg.get("rope_parameters") or {}
    out = {}
    for kind, theta_key, default in (
        ("full_attention", "global_rope_theta", 160_000.0),
        ("sliding_attention", "local_rope_theta", 10_000.0),
    ):
        # As transformers: old-style rope_scaling applies to both kinds.
        params = {**(nested.get(kind) or {}), **(cfg.get("rope_scaling") or {})}
        params.setdefault("rope_theta", cfg.get(theta_key, default))
        out[kind] = rope_parameters(
            {"rope_parameters": params, "max_position_embeddings": cfg.get("max_position_embeddings")}
        )
    return out


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.norm = _norm(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(ids))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], window: int | None):
        super().__init__()
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        bias = cfg.get("attention_bias", False)
        self.head_dim, self.window = h // heads, window
        self.Wqkv = QKVParallelLinear(h, self.head_dim, heads, heads, bias)
        _load_packed(self.Wqkv, ["q", "k", "v"])
        self.num_heads = self.Wqkv.num_heads
        self.Wo = RowParallelLinear(h, h, bias, "hidden size")

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.Wqkv(x).view(t, 3 * self.num_heads, self.head_dim).split(self.num_heads, dim=1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = varlen_attention(q, k, v, batch, causal=False, window=self.window)  # (T, H_r, D)
        return self.Wo(out.reshape(t, self.num_heads * self.head_dim))


class ModernBertMLP(nn.Module):
    """Wo(act(input) * gate) with [input | gate] = Wi(x)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, i, bias = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False)
        self.Wi = MergedColumnParallelLinear(h, [i, i], bias)
        _load_packed(self.Wi, [0, 1])
        self.act_name = cfg.get("hidden_activation", "gelu")
        get_activation(self.act_name)  # refuse an unknown activation at build time
        self.Wo = RowParallelLinear(i, h, bias, "intermediate size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (T, 2 I_r) -> (T, I_r): act(input) * gate, one kernel where it can be
        return self.Wo(act_and_mul(self.Wi(x), self.act_name))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, kind: str):
        super().__init__()
        # The first layer's attention norm is an identity (the embeddings end with a norm).
        self.attn_norm = _norm(cfg) if index else nn.Identity()
        window = cfg.get("local_attention", 128) // 2 if kind == "sliding_attention" else None
        self.attn = ModernBertAttention(cfg, window)
        self.mlp_norm = _norm(cfg)
        self.mlp = ModernBertMLP(cfg)
        self.kind = kind

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        normed, h = self.mlp_norm(self.attn(self.attn_norm(x), batch, cos, sin), x)
        return h + self.mlp(normed)


class ModernBertModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states (after the final norm)."""

    checkpoint_prefixes = ("model.",)
    ignored_weights = ("head.", "decoder.", "classifier.")

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.config
        kinds = layer_kinds(cfg)
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i, kind) for i, kind in enumerate(kinds))
        self.final_norm = _norm(cfg)
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        # Buffers only (no checkpoint tensors): one rotary table per layer kind.
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(head_dim, params) for kind, params in rope_by_kind(cfg).items()}
        )

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        tables = {kind: rope(batch.positions) for kind, rope in self.rotary.items()}
        x = self.embeddings(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, *tables[cast(ModernBertEncoderLayer, layer).kind])
        return self.final_norm(x)

    def add_mlm_head(self, cfg: dict[str, Any]) -> None:
        """ModernBertForMaskedLM's ``head.*`` and ``decoder.*`` (SPLADE models only), as models/bert.py's."""
        self.head = ModernBertPredictionHead(cfg)
        self.decoder = ModernBertDecoder(cfg, self.embeddings.tok_embeddings)

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, V_r): the logits of this rank's rows of the vocabulary."""
        weight = (
            self.decoder.weight if self.decoder.weight is not None else self.embeddings.tok_embeddings.weight
        )
        return F.linear(self.head(hidden), weight, self.decoder.bias)


class ModernBertPredictionHead(nn.Module):
    """dense (classifier_bias), classifier_activation, norm."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h = cfg["hidden_size"]
        self.dense = ReplicatedLinear(h, h, bias=cfg.get("classifier_bias", False))
        self.act = get_activation(cfg.get("classifier_activation", "gelu"))
        self.norm = _norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertDecoder(nn.Module):
    """The decoder's bias (decoder_bias) and, untied only, its weight: this rank's vocabulary rows, as the
    embedding table it is otherwise tied to."""

    def __init__(self, cfg: dict[str, Any], table: VocabParallelEmbedding):
        super().__init__()
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if cfg.get("tie_word_embeddings", True) is False:
            self.weight = nn.Parameter(torch.empty_like(table.weight), requires_grad=False)
            self.weight.weight_loader = table.weight_loader  # type: ignore[attr-defined]
        if cfg.get("decoder_bias", True):
            self.bias = nn.Parameter(torch.empty(table.per_rank), requires_grad=False)
            self.bias.weight_loader = table.weight_loader  # type: ignore[attr-defined]
