"""SigLIP (``SiglipModel``; SigLIP 2 checkpoints at a fixed resolution use the same architecture).

The towers are CLIP's pre-norm layers (clip.py) with SigLIP's differences, as transformers' modeling_siglip:
the text tower attends bidirectionally, takes the last token of the sequence it is given (SigLIP texts are
padded to ``max_position_embeddings`` with the pad token, as the model was trained: the front end pads
them), applies ``final_layer_norm`` and its own ``head`` (a linear layer with bias). The vision tower has
no class token and no pre-norm: patches (a convolution with bias) + positions, the layers,
``post_layernorm`` on every token, then the multi-head attention pooling head: one learned ``probe`` query
attends over the image's tokens (torch's MultiheadAttention weights, packed ``in_proj_weight``), then
x + mlp(layernorm(x)).

Tensor parallelism: as clip.py, and the pooling head's attention split by heads like the layers' (its packed
q/k/v weight narrowed per rank, ``out_proj`` by rows, its MLP ``fc1`` by columns and ``fc2`` by rows).

Siglip2Model (NaFlex: variable resolution, pre-patchified pixels with their spatial shapes) is another
architecture and is not served.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embed_service.layers.embedding import ReplicatedEmbedding
from embed_service.layers.linear import (
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    dense,
    divide,
)
from embed_service.layers.norm import LayerNorm
from embed_service.models.clip import (
    PatchEmbedding,
    TextEmbeddings,
    TowerEncoder,
    TowerMLP,
    TwoTowerModel,
    image_batch,
)
from embed_service.models.towers import tower
from embed_service.ops.batch import FlatBatch
from embed_service.parallel import tp_rank, tp_world_size


class SiglipTextTransformer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TowerEncoder(cfg)
        self.final_layer_norm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])
        self.head = ReplicatedLinear(
            cfg["hidden_size"], int(cfg.get("projection_size") or cfg["hidden_size"])
        )

    def forward(self, batch: FlatBatch, tokens: int) -> torch.Tensor:
        """(B, projection): each real sequence's last token, normed, through the head."""
        hidden = self.encoder(self.embeddings(batch), batch, causal=False)
        cu = batch.cu_seqlens[1:].long()
        last = cu[cu <= tokens] - 1
        return self.head(self.final_layer_norm(hidden[last]))


class PoolingAttention(nn.Module):
    """torch.nn.MultiheadAttention's parameters (``in_proj_weight`` (3H, H) packed q|k|v, ``in_proj_bias``,
    ``out_proj``), this rank's heads of each of q, k and v; one query per image."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads = divide(heads, tp_world_size(), "pooling head's attention heads")
        width = self.num_heads * self.head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, hidden), requires_grad=False)
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width), requires_grad=False)
        for p in (self.in_proj_weight, self.in_proj_bias):
            p.weight_loader = self.in_proj_loader  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(hidden, hidden, True, "pooling head's features")

    def in_proj_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        full, width = loaded.shape[0] // 3, param.shape[0] // 3
        parts = [loaded.narrow(0, i * full + tp_rank() * width, width) for i in range(3)]
        default_weight_loader(param, torch.cat(parts))

    def forward(self, probe: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """probe (H,), x (B, N, H) -> (B, H)."""
        b, n, _ = x.shape
        heads, d = self.num_heads, self.head_dim
        w_q, w_kv = self.in_proj_weight.split([heads * d, 2 * heads * d])
        b_q, b_kv = self.in_proj_bias.split([heads * d, 2 * heads * d])
        q = dense(probe[None].to(x.dtype), w_q, b_q).view(1, heads, 1, d).expand(b, heads, 1, d)
        kv = dense(x.reshape(b * n, -1), w_kv, b_kv).view(b, n, 2, heads, d)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, heads, N, D)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, 1, D)
        return self.out_proj(out.reshape(b, heads * d))


class SiglipMultiheadAttentionPoolingHead(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, cfg["hidden_size"]), requires_grad=False)
        self.attention = PoolingAttention(cfg["hidden_size"], cfg["num_attention_heads"])
        self.layernorm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])
        self.mlp = TowerMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.probe.view(-1), x)  # (B, H)
        return h + self.mlp(self.layernorm(h))


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.patch_embedding = PatchEmbedding(cfg, bias=True)
        self.num_positions = self.patch_embedding.grid**2
        self.position_embedding = ReplicatedEmbedding(self.num_positions, cfg["hidden_size"])

    def forward(self, pixels: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        x = self.patch_embedding(pixels).reshape(-1, self.position_embedding.weight.shape[1])
        return x + self.position_embedding(batch.positions)


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        if not cfg.get("vision_use_head", True):
            raise ValueError(
                "config.json: vision_config.vision_use_head is false: this SigLIP vision tower has no pooled "
                "output (get_image_features gives none), so it gives no image embedding"
            )
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = TowerEncoder(cfg)
        self.post_layernorm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])
        self.head = SiglipMultiheadAttentionPoolingHead(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        n = self.embeddings.num_positions
        batch = image_batch(pixels.shape[0], n, pixels.device)
        x = self.encoder(self.embeddings(pixels, batch), batch, causal=False)
        x = self.post_layernorm(x)
        return self.head(x.view(pixels.shape[0], n, -1))


class SiglipModel(TwoTowerModel):
    def __init__(self, spec: Any):
        super().__init__()
        cfg = spec.config
        self.text_model = SiglipTextTransformer(tower(cfg, "SiglipModel", "text_config"))
        self.vision_model = SiglipVisionTransformer(tower(cfg, "SiglipModel", "vision_config"))
