"""Gemma 2 and Gemma 3 text decoders (EmbeddingGemma is a bidirectional Gemma 3), on the flat token stream.

What sets them apart from the Llama block of decoder.py: RMSNorm scales by ``1 + weight`` (in float32), a
norm after attention and after the MLP as well as before each, the token embedding multiplied by
sqrt(hidden_size) (rounded to the weights' dtype, as transformers does), a GELU-tanh gated MLP, scores scaled
by ``query_pre_attn_scalar ** -0.5`` rather than head_dim's, and local (sliding-window) and global layers per
``layer_types``. Gemma 2 soft-caps the attention logits (``attn_logit_softcapping``); Gemma 3 normalizes each
query and key head instead and gives local and global layers their own rope theta. (Gemma 3's config may
carry ``attn_logit_softcapping``, but transformers' Gemma 3 never applies it, and the released checkpoints
set it null; it is ignored here too.)

Windows follow transformers' masks: a causal layer sees the query and the W - 1 keys before it; a
bidirectional Gemma 3 (``use_bidirectional_attention``, EmbeddingGemma) sees keys up to W // 2 positions
away on either side (transformers loads such a config's window as W // 2 + 1, exclusive).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from embed_service.layers.activation import get_activation
from embed_service.layers.embedding import VocabParallelEmbedding
from embed_service.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from embed_service.layers.norm import GemmaRMSNorm
from embed_service.layers.rotary import RotaryEmbedding, rope_parameters
from embed_service.models.decoder import DecoderModel, rotary_qkv
from embed_service.models.spec import ModelSpec
from embed_service.ops.batch import FlatBatch
from embed_service.ops.scored_attention import varlen_attention_scored

FULL, SLIDING = "full_attention", "sliding_attention"


class GemmaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], window: int | None, causal: bool, qk_norm: bool, softcap):
        super().__init__()
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        d = self.head_dim = cfg.get("head_dim") or 256
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(h, d, heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * d, h, bias, "query features")
        self.qk_norm = qk_norm
        if qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = GemmaRMSNorm(d, eps), GemmaRMSNorm(d, eps)
        self.scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
        self.window, self.causal, self.softcap = window, causal, softcap

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = rotary_qkv(self, x, cos, sin)
        out = varlen_attention_scored(
            q, k, v, batch, self.causal, self.scale, self.window, softcap=self.softcap
        )  # (T, H_r, D)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias=False)
        self.down_proj = RowParallelLinear(i, h, False, "intermediate size")
        self.act = get_activation(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I_r) each
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], kind: str, window: int | None, causal: bool, qk_norm: bool, softcap
    ):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, window if kind == SLIDING else None, causal, qk_norm, softcap)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, batch: FlatBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2Model(nn.Module):
    """(T,) token ids -> (T, hidden) last hidden states (after the final norm)."""

    packed_modules_mapping = DecoderModel.packed_modules_mapping
    checkpoint_prefixes = ("model.",)
    ignored_weights = ("lm_head.",)

    qk_norm = False
    sliding_window_pattern = 2  # every second layer global, when the config has no layer_types

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.config
        h = cfg["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], h)
        self.embed_scale = math.sqrt(h)
        window = cfg.get("sliding_window") or 4096
        window = window // 2 if not spec.causal else window - 1
        softcap = self.softcap(cfg)
        self.check(spec)
        self.kinds = self.layer_kinds(cfg)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, kind, window, spec.causal, self.qk_norm, softcap) for kind in self.kinds
        )
        self.norm = GemmaRMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        head_dim = cfg.get("head_dim") or 256
        # Buffers only (no checkpoint tensors): one rotary table per layer kind.
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(head_dim, params) for kind, params in self.rope_by_kind(cfg).items()}
        )

    def check(self, spec: ModelSpec) -> None:
        if not spec.causal:
            # transformers' Gemma 2 keeps its causal masks whatever the config says: no reference to match.
            raise ValueError("a bidirectional Gemma 2 (use_bidirectional_attention) is not supported")

    @classmethod
    def softcap(cls, cfg: dict[str, Any]) -> float | None:
        value = cfg.get("attn_logit_softcapping", 50.0)
        return float(value) if value else None

    @classmethod
    def layer_kinds(cls, cfg: dict[str, Any]) -> list[str]:
        if cfg.get("layer_types"):
            return list(cfg["layer_types"])
        every = cfg.get("sliding_window_pattern", cls.sliding_window_pattern)
        return [SLIDING if (i + 1) % every else FULL for i in range(cfg["num_hidden_layers"])]

    @classmethod
    def rope_by_kind(cls, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
        params = rope_parameters(cfg)
        return {FULL: params, SLIDING: params}

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        tables = {kind: rope(batch.positions) for kind, rope in self.rotary.items()}
        w = self.embed_tokens.weight
        x = self.embed_tokens(batch.input_ids) * torch.tensor(
            self.embed_scale, dtype=w.dtype, device=w.device
        )
        for kind, layer in zip(self.kinds, self.layers):
            x = layer(x, batch, *tables[kind])
        return self.norm(x)


class Gemma3TextModel(Gemma2Model):
    """Gemma 3's text decoder: per-head query/key norms, no soft-capping, a global and a local rope theta,
    five local layers to a global one by default, bidirectional when the config asks (EmbeddingGemma)."""

    qk_norm = True
    sliding_window_pattern = 6

    def check(self, spec: ModelSpec) -> None:
        pass

    @classmethod
    def softcap(cls, cfg: dict[str, Any]) -> float | None:
        return None

    @classmethod
    def rope_by_kind(cls, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The global and local rope settings, from ``rope_parameters`` per layer kind (transformers 5) or the
        older ``rope_theta`` / ``rope_scaling`` (global layers) and ``rope_local_base_freq`` (local)."""
        nested = cfg.get("rope_parameters") or {}
        limits = {"max_position_embeddings": cfg.get("max_position_embeddings")}
        if FULL in nested or SLIDING in nested:
            return {
                kind: rope_parameters({"rope_parameters": nested.get(kind) or {}, **limits}, default)
                for kind, default in ((FULL, 1_000_000.0), (SLIDING, 10_000.0))
            }
        full = rope_parameters(
            {
                "rope_scaling": cfg.get("rope_scaling"),
                "rope_theta": cfg.get("rope_theta", 1_000_000.0),
                **limits,
            }
        )
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        return {FULL: full, SLIDING: local}
