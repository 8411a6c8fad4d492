"""Decoder-only transformers used as embedders: Llama, Mistral, Qwen2, Qwen3.

One pre-norm block serves all four: RMSNorm, rotary attention with grouped-query heads (``head_dim`` need
not be hidden / heads), a SwiGLU MLP. They differ only in small switches resolved from config.json with each
architecture's transformers defaults: query/key/value biases (always on for Qwen2), per-head RMSNorm of
queries and keys (Qwen3), sliding-window layers (Mistral; Qwen with ``use_sliding_window``).

Attention is causal unless the config asks for bidirectional attention (``is_causal: false``,
``use_bidirectional_attention: true``); the spec decides. Module names mirror the checkpoint; the separate
q/k/v and gate/up projections load into packed layers. ``lm_head`` is never needed for embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from embed_service.layers.activation import act_and_mul, get_activation
from embed_service.layers.embedding import VocabParallelEmbedding
from embed_service.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from embed_service.layers.norm import RMSNorm
from embed_service.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from embed_service.models.spec import ModelSpec
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch


@dataclass(frozen=True)
class DecoderArgs:
    """The switches one decoder layer needs, resolved from config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    causal: bool
    windows: list[int | None]
    """Per layer: the farthest key a query may see (inclusive), or None for the whole sequence."""


def rotary_qkv(
    attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a decoder attention (its qkv_proj, head counts, optional per-head q/k norm), the rotary
    applied: (T, H_r, D), (T, Hkv_r, D), (T, Hkv_r, D). Shared by every decoder family (gemma.py too)."""
    t, d = x.shape[0], attn.head_dim
    q, k, v = attn.qkv_proj(x).split([attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d], -1)
    q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class DecoderAttention(nn.Module):
    def __init__(self, a: DecoderArgs, window: int | None):
        super().__init__()
        self.head_dim, self.causal, self.window = a.head_dim, a.causal, window
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, a.o_bias, "query features")
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.qk_norm = a.qk_norm

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = rotary_qkv(self, x, cos, sin)
        out = varlen_attention(q, k, v, batch, causal=self.causal, window=self.window)  # (T, H_r, D)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class DecoderMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            a.hidden_size, [a.intermediate_size, a.intermediate_size], a.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            a.intermediate_size, a.hidden_size, a.mlp_bias, "intermediate size"
        )
        get_activation(a.hidden_act)  # refuse an unknown activation at build time
        self.act_name = a.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (T, 2 I_r) -> (T, I_r): act(gate) * up, one kernel where it can be
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act_name))


class DecoderLayer(nn.Module):
    def __init__(self, a: DecoderArgs, window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DecoderAttention(a, window)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DecoderMLP(a)

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        normed, h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, cos, sin), x)
        return h + self.mlp(normed)


class DecoderModel(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states (after the final norm). Llama by default."""

    packed_modules_mapping = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", "q"),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", "k"),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", "v"),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", 1),
    }
    checkpoint_prefixes = ("model.",)
    ignored_weights = ("lm_head.",)
    ignored_fragments = (".rotary_emb.inv_freq",)  # saved by some older checkpoints; recomputed here

    # Architecture switches, as transformers' config classes and modeling files set them.
    qkv_bias_always = False
    qk_norm = False
    default_head_dim: int | None = None  # None: hidden_size / num_attention_heads

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.config
        a = self.resolve_args(cfg, spec.causal)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, w) for w in a.windows)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(a.head_dim, rope_parameters(cfg))

    @classmethod
    def resolve_args(cls, cfg: dict[str, Any], causal: bool) -> DecoderArgs:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cls.default_head_dim or cfg["hidden_size"] // heads
        attention_bias = bool(cfg.get("attention_bias", False))
        windows = cls.sliding_windows(cfg)
        return DecoderArgs(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            hidden_act=cfg.get("hidden_act", "silu"),
            qkv_bias=cls.qkv_bias_always or attention_bias,
            o_bias=attention_bias and not cls.qkv_bias_always,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=cls.qk_norm,
            causal=causal,
            # transformers' masks: causal windows hold the query and the W - 1 keys before it;
            # bidirectional ones every key within W of the query.
            windows=[None if w is None else (w - 1 if causal else w) for w in windows],
        )

    @classmethod
    def sliding_windows(cls, cfg: dict[str, Any]) -> list[int | None]:
        """Per layer, the config's sliding window or None. Llama has none."""
        return [None] * cfg["num_hidden_layers"]

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        cos, sin = self.rotary_emb(batch.positions)  # (T, 1, D) each, shared by every layer
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, cos, sin)
        return self.norm(x)


LlamaModel = DecoderModel


class MistralModel(DecoderModel):
    """Llama with sliding-window attention on every layer (``sliding_window``, 4096 when absent)."""

    @classmethod
    def sliding_windows(cls, cfg: dict[str, Any]) -> list[int | None]:
        return [cfg.get("sliding_window", 4096)] * cfg["num_hidden_layers"]


class Qwen2Model(DecoderModel):
    """Biases on query, key and value (not on the output projection), whatever the config says."""

    qkv_bias_always = True

    @classmethod
    def sliding_windows(cls, cfg: dict[str, Any]) -> list[int | None]:
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        n = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28) else "full"
            for i in range(n)
        ]
        return [window if kind == "sliding_attention" else None for kind in layer_types]


class Qwen3Model(Qwen2Model):
    """Qwen2 with per-head RMSNorm on queries and keys, biases per ``attention_bias``, head_dim 128 default."""

    qkv_bias_always = False
    qk_norm = True
    default_head_dim = 128
