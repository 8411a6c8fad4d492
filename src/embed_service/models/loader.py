"""Build a model from its spec and load its weights straight from the checkpoint files.

The model is built with uninitialized (``torch.empty``) parameters in the target dtype on the target device,
and each checkpoint tensor is handed to its parameter's ``weight_loader``, which narrows it to this rank's
shard. (Not the meta device: materializing from meta makes new Parameters and drops their loaders.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from embed_service.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    small_linear_serves,
    small_rows,
)
from embed_service.models import scoring
from embed_service.models.checkpoint import weight_files
from embed_service.models.heads import OutputHeads, SpladeHead, load_linear
from embed_service.models.spec import DenseSpec, ModelSpec
from embed_service.ops import invariance
from embed_service.ops.batch import FlatBatch, padded_tokens
from embed_service.ops.pooling import POOLERS
from embed_service.outputs import OutputRequest, SequenceOutput


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the safetensors files in a folder (else pytorch_model*.bin)."""
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_weights(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters())
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    prefixes: tuple[str, ...] = getattr(model, "checkpoint_prefixes", ())
    ignored: tuple[str, ...] = getattr(model, "ignored_weights", ())
    ignored_fragments: tuple[str, ...] = getattr(model, "ignored_fragments", ())
    loaded: set[str] = set()
    shards_loaded: dict[str, set[object]] = {}  # a packed parameter -> the shards the checkpoint filled
    for name, tensor in iter_checkpoint(path):
        for prefix in prefixes:
            if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in dict(model.named_children()):
                name = name[len(prefix) :]
                break
        shard = None
        for fragment, (target, shard_id) in mapping.items():
            if fragment in name:
                name, shard = name.replace(fragment, target), shard_id
                break
        if name not in params:
            if any(name.startswith(i) for i in ignored) or any(f in name for f in ignored_fragments):
                continue
            raise ValueError(f"{path}: checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[name]
        loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
            shards_loaded.setdefault(name, set()).add(shard)
        loaded.add(name)
    tied = getattr(model, "tied_weights", {})
    for name, source in tied.items():
        if name not in loaded and source in loaded:
            params[name].data.copy_(params[source].data)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    # A packed parameter (q, k and v in one) with a shard missing would keep that shard uninitialized.
    for name, got in shards_loaded.items():
        for fragment, (target, shard_id) in mapping.items():
            if target in name and shard_id not in got:
                missing.append(name.replace(target, fragment))
    if missing:
        raise ValueError(
            f"{path}: weights missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


class DenseHead(nn.Module):
    """sentence-transformers Dense: linear then activation, in float32."""

    def __init__(self, spec: DenseSpec):
        super().__init__()
        self.linear = ReplicatedLinear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = torch.tanh if spec.activation == "tanh" else (lambda x: x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


class TwoTowers:
    """A CLIP or SigLIP model's batch: its texts through the text tower (flat, padding-free), its images
    (OutputRequest.pixels) through the vision tower, one pass each; dense vectors only."""

    def __init__(self, spec: ModelSpec, model: Any, dtype: torch.dtype):
        from embed_service.models import towers

        size = towers.image_size(spec.config, spec.family.cls)
        self.model, self.dtype, self.image_shape = model, dtype, (3, size, size)
        self.pad_length = min(64, spec.position_limit)  # dummy sequences' positions stay in the table
        self.text_padding = spec.text_padding

    def __call__(self, batch: FlatBatch, requests: list[OutputRequest]) -> list[SequenceOutput]:
        outs = [SequenceOutput() for _ in requests]
        texts = [i for i, r in enumerate(requests) if not r.pixels]
        images = [i for i, r in enumerate(requests) if r.pixels]
        device = batch.input_ids.device
        if texts:
            if images or self.text_padding is not None:  # the texts alone, laid end to end again
                batch = self._texts(batch, texts).to(device)
            tokens = int(batch.cu_seqlens[-1])
            run = batch.padded(padded_tokens(tokens), self.pad_length) if device.type == "cpu" else batch
            for i, row in zip(texts, self.model.text_features(run, tokens).cpu().numpy()):
                outs[i].dense = row
        if images:
            flat = np.stack([np.frombuffer(requests[i].pixels, np.float32) for i in images])
            pixels = torch.from_numpy(flat.reshape(len(images), *self.image_shape)).to(device, self.dtype)
            for i, row in zip(images, self.model.image_features(pixels).cpu().numpy()):
                outs[i].dense = row
        return outs

    def _texts(self, batch: FlatBatch, texts: list[int]) -> FlatBatch:
        """The flat batch of sequences `texts` only, each padded to the text padding's length if any."""
        cu = batch.cu_seqlens.tolist()
        seqs = [batch.input_ids[cu[i] : cu[i + 1]].cpu() for i in texts]
        if self.text_padding is not None:
            length, pad = self.text_padding
            seqs = [torch.cat([s, torch.full((length - len(s),), pad, dtype=s.dtype)]) for s in seqs]
        return FlatBatch.from_lengths(torch.cat(seqs), [len(s) for s in seqs])


class EmbeddingModel(nn.Module):
    """Transformer -> output heads: (T,) token ids and one OutputRequest per sequence -> one SequenceOutput
    per sequence (models/heads.py). Dense vectors come out not normalized.

    Normalization and Matryoshka truncation are per request, so they happen after this, in the engine.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.spec = spec
        prev = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with device:
                self.model = spec.family.load_class()(spec)
                if spec.splade is not None:  # the masked-LM head, for SPLADE models only
                    self.model.add_mlm_head(spec.config)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, spec.path)
        self.towers: TwoTowers | None = TwoTowers(spec, self.model, dtype) if spec.family.towers else None
        dense = nn.ModuleList()
        for d in spec.dense:
            head = DenseHead(d)
            load_weights(head, d.path)
            dense.append(head.to(device))
        # The body's linear layers (their weights read at each forward: the fidelity check swaps them).
        self._matmuls = [
            m
            for m in self.model.modules()
            if isinstance(m, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear))
        ]
        self._small_body: tuple[tuple | None, bool] = (None, False)
        self.heads = OutputHeads(
            POOLERS[spec.pooling] if self.towers is None else POOLERS["cls"],  # towers pool their own
            dense,
            load_linear(spec.sparse_head, device) if spec.sparse_head else None,
            load_linear(spec.colbert_head, device) if spec.colbert_head else None,
            scoring.load_head(spec, device) if spec.score else None,
            SpladeHead(self.model.mlm_logits, spec.splade, int(spec.config["vocab_size"]))
            if spec.splade is not None
            else None,
        )

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, requests: list[OutputRequest]) -> list[SequenceOutput]:
        if self.towers is not None:
            return self.towers(batch, requests)
        tokens = int(batch.cu_seqlens[-1])
        run = batch.padded(padded_tokens(tokens)) if self._pads(batch, tokens) else batch
        hidden = self.model(run)[:tokens]  # (T, H): the real rows
        return self.heads(hidden, batch.input_ids[:tokens], batch.cu_seqlens, requests)

    def _pads(self, batch: FlatBatch, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens runs padded to a step of token counts (ops/batch.padded_tokens):
        on a CPU, so that oneDNN meets a few matmul shapes rather than a new one every batch; not where every
        matmul of the body runs on the project's short-sequence kernel (layers/linear.small_linear_serves at
        this count, batch invariance off, no masked-LM head): that kernel generates no code per shape, and the
        padding rows would be work for nothing (17 tokens ran as 32)."""
        if batch.input_ids.device.type != "cpu":
            return False
        rows = small_rows()
        if tokens > rows or invariance.enabled() or self.spec.splade is not None or not self._matmuls:
            return True
        # Whether the kernel serves every one of them, decided again when what it depends on changes: the
        # kernel's rows, the weights' dtype and storage (the fidelity check's float32 pass), int8 marks.
        first, last = self._matmuls[0].weight, self._matmuls[-1].weight
        key = (rows, first.dtype, first.data_ptr(), last.dtype, getattr(last, "int8", False))
        if self._small_body[0] != key:
            self._small_body = (key, all(small_linear_serves(m.weight) for m in self._matmuls))
        return not self._small_body[1]

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
