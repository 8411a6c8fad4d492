"""CLIP (``CLIPModel``): a text tower and a vision tower whose projections share one vector space.

Both towers are pre-norm transformers on the flat stream (ops/batch.py): ``layer_norm1`` -> attention ->
residual, ``layer_norm2`` -> MLP (``fc1``, activation, ``fc2``) -> residual. The text tower attends causally
and pools the end-of-text token exactly as transformers' CLIPTextTransformer picks it: with the legacy
``eos_token_id`` 2 the position of the highest token id (its first occurrence), otherwise the first position
of ``eos_token_id`` (position 0 when the text has none); then ``final_layer_norm`` (before pooling) and
``text_projection``. The vision tower cuts the image into patches (the stride-patch convolution, written as
one matmul), puts the class token in front, adds the position table, applies ``pre_layrnorm`` (sic, the
checkpoint's name), the layers, ``post_layernorm`` on the class token, and ``visual_projection``.

Each image is one sequence of 1 + (image_size / patch_size)**2 tokens in the flat stream, attended
bidirectionally by the same varlen kernel as text. Tensor parallelism as in the text families: q/k/v and
``fc1`` split by columns (heads), ``out_proj`` and ``fc2`` by rows, the token table by rows; the patch
matmul, position tables and projections are small and replicated.

Module names mirror the checkpoint; siglip.py builds SigLIP from the same layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embed_service.layers.activation import ACTIVATIONS, linear_act
from embed_service.layers.embedding import ReplicatedEmbedding, VocabParallelEmbedding
from embed_service.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, dense
from embed_service.layers.norm import LayerNorm
from embed_service.models.encoder import PackedSelfAttention
from embed_service.models.towers import dimension, tower
from embed_service.ops.attention import varlen_attention
from embed_service.ops.batch import FlatBatch


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's x * sigmoid(1.702 x) (transformers' QuickGELUActivation)."""
    return x * torch.sigmoid(1.702 * x)


def tower_activation(name: str):
    if name == "quick_gelu":
        return quick_gelu
    if name not in ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {sorted([*ACTIVATIONS, 'quick_gelu'])}"
        )
    return None  # a shared one: linear_act fuses it where it can


class TowerAttention(PackedSelfAttention):
    """``q_proj``/``k_proj``/``v_proj`` (packed, this rank's heads) and ``out_proj``; scale 1 / sqrt(D)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.out_proj = RowParallelLinear(cfg["hidden_size"], cfg["hidden_size"], True, "attention features")

    def forward(self, x: torch.Tensor, batch: FlatBatch, causal: bool) -> torch.Tensor:
        q, k, v = self.heads(x)
        return self.out_proj(self.merge(varlen_attention(q, k, v, batch, causal=causal)))


class TowerMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            cfg["hidden_size"], cfg["intermediate_size"], what="intermediate size"
        )
        self.fc2 = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"], what="intermediate size")
        self.act_name = cfg["hidden_act"]
        self.own_act = tower_activation(self.act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_act is not None:
            h = self.own_act(dense(x, self.fc1.weight, self.fc1.bias))
        else:
            h = linear_act(x, self.fc1.weight, self.fc1.bias, self.act_name)
        return self.fc2(h)


class TowerLayer(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then h + mlp(ln2(h)) (the second add fused into ln2 where it can be)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        eps = cfg["layer_norm_eps"]
        self.layer_norm1 = LayerNorm(cfg["hidden_size"], eps)
        self.self_attn = TowerAttention(cfg)
        self.layer_norm2 = LayerNorm(cfg["hidden_size"], eps)
        self.mlp = TowerMLP(cfg)

    def forward(self, x: torch.Tensor, batch: FlatBatch, causal: bool) -> torch.Tensor:
        normed, h = self.layer_norm2(self.self_attn(self.layer_norm1(x), batch, causal), x)
        return h + self.mlp(normed)


class TowerEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.layers = nn.ModuleList(TowerLayer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor, batch: FlatBatch, causal: bool) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, batch, causal)
        return x


class TextEmbeddings(nn.Module):
    """``token_embedding`` + ``position_embedding`` (CLIP and SigLIP alike: no norm, no token types)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.token_embedding = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.position_embedding = ReplicatedEmbedding(cfg["max_position_embeddings"], cfg["hidden_size"])

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        return self.token_embedding(batch.input_ids) + self.position_embedding(batch.positions)


class PatchEmbedding(nn.Module):
    """The stride-patch Conv2d as one matmul: (B, C, S, S) pixels -> (B, N, hidden), patches row-major as
    the convolution's output flattens them. ``weight`` is the checkpoint's (hidden, C, p, p)."""

    def __init__(self, cfg: dict[str, Any], bias: bool):
        super().__init__()
        h, c, p = cfg["hidden_size"], cfg["num_channels"], cfg["patch_size"]
        self.patch, self.channels, self.image_size = p, c, cfg["image_size"]
        self.grid = self.image_size // p
        self.weight = nn.Parameter(torch.empty(h, c, p, p), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(h), requires_grad=False) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        b, c, height, width = pixels.shape
        if (c, height, width) != (self.channels, self.image_size, self.image_size):
            raise ValueError(
                f"pixel values of shape {(c, height, width)}; the model takes "
                f"{(self.channels, self.image_size, self.image_size)}"
            )
        g, p = self.grid, self.patch
        x = pixels[:, :, : g * p, : g * p].to(self.weight.dtype)  # a valid convolution drops the remainder
        x = x.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b * g * g, c * p * p)
        out = dense(x, self.weight.reshape(self.weight.shape[0], -1), self.bias)
        return out.view(b, g * g, -1)


def image_batch(images: int, tokens: int, device: torch.device) -> FlatBatch:
    """The flat batch of `images` sequences of `tokens` each (positions 0 .. tokens - 1)."""
    return FlatBatch.from_lengths(torch.zeros(images * tokens, dtype=torch.long), [tokens] * images).to(
        device
    )


def eos_positions(ids: torch.Tensor, cu_seqlens: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B,) flat rows of each text's pooled token, as CLIPTextTransformer picks it (see the module doc)."""
    bounds = cu_seqlens.tolist()
    rows = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        seq = ids[s:e]
        if eos_token_id == 2:
            at = int(seq.argmax())
        else:
            hits = (seq == eos_token_id).nonzero()
            at = int(hits[0]) if hits.numel() else 0
        rows.append(s + at)
    return torch.tensor(rows, device=ids.device)


class CLIPTextTransformer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.eos_token_id = int(cfg["eos_token_id"])
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TowerEncoder(cfg)
        self.final_layer_norm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])

    def forward(self, batch: FlatBatch, tokens: int) -> torch.Tensor:
        """(B, hidden): the end-of-text rows of the first `tokens` (the real ones) after the final norm."""
        hidden = self.final_layer_norm(self.encoder(self.embeddings(batch), batch, causal=True))
        real = batch.cu_seqlens[: batch.num_seqs + 1]
        cu = real[real <= tokens]
        return hidden[eos_positions(batch.input_ids[:tokens], cu, self.eos_token_id)]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg["hidden_size"]), requires_grad=False)
        self.patch_embedding = PatchEmbedding(cfg, bias=False)
        self.num_positions = self.patch_embedding.grid**2 + 1
        self.position_embedding = ReplicatedEmbedding(self.num_positions, cfg["hidden_size"])

    def forward(self, pixels: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        patches = self.patch_embedding(pixels)  # (B, N, H)
        cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], 1).reshape(-1, patches.shape[-1])
        return x + self.position_embedding(batch.positions)


class CLIPVisionTransformer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])
        self.encoder = TowerEncoder(cfg)
        self.post_layernorm = LayerNorm(cfg["hidden_size"], cfg["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, hidden): the class token after post_layernorm."""
        n = self.embeddings.num_positions
        batch = image_batch(pixels.shape[0], n, pixels.device)
        x = self.pre_layrnorm(self.embeddings(pixels, batch))
        x = self.encoder(x, batch, causal=False)
        return self.post_layernorm(x[batch.cu_seqlens[:-1].long()])


class TwoTowerModel(nn.Module):
    """What the engine calls on a CLIP or SigLIP model: text_features over a flat token batch, image_features
    over a (B, C, S, S) pixel batch; both (B, projection) float32, not normalized."""

    packed_modules_mapping = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", "q"),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", "k"),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", "v"),
    }
    checkpoint_prefixes: tuple[str, ...] = ()
    ignored_weights: tuple[str, ...] = ("logit_scale", "logit_bias")
    ignored_fragments = (".position_ids",)  # buffers some checkpoints saved; recomputed here
    text_model: nn.Module
    vision_model: nn.Module

    def text_features(self, batch: FlatBatch, tokens: int | None = None) -> torch.Tensor:
        """`tokens`: the real tokens of a batch padded past them (ops/batch.py FlatBatch.padded)."""
        return self.text_model(batch, int(batch.cu_seqlens[-1]) if tokens is None else tokens).float()

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixels).float()


class CLIPModel(TwoTowerModel):
    def __init__(self, spec: Any):
        super().__init__()
        cfg = spec.config
        text, vision = tower(cfg, "CLIPModel", "text_config"), tower(cfg, "CLIPModel", "vision_config")
        projection = dimension(cfg, "CLIPModel")
        self.text_model = CLIPTextTransformer(text)
        self.vision_model = CLIPVisionTransformer(vision)
        self.text_projection = ReplicatedLinear(text["hidden_size"], projection, bias=False)
        self.visual_projection = ReplicatedLinear(vision["hidden_size"], projection, bias=False)

    def text_features(self, batch: FlatBatch, tokens: int | None = None) -> torch.Tensor:
        pooled = self.text_model(batch, int(batch.cu_seqlens[-1]) if tokens is None else tokens)
        return self.text_projection(pooled).float()

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.visual_projection(self.vision_model(pixels)).float()
